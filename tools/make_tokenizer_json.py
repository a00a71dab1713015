#!/usr/bin/env python3
"""Builds a Hugging Face tokenizer.json for the Qwen3.6 vocabulary from its tiktoken rank file.

transformers' TikTokenConverter turns the ranks into a BPE vocabulary and merge list; transformers'
own Qwen3_5Tokenizer class then supplies the pipeline of the published model (NFC normaliser, the
Qwen3.5 split regex, byte-level pre-tokenizer and decoder), and the 33 added tokens get ids 248044..
in the published order. The output directory receives tokenizer.json and tokenizer_config.json,
like a model directory. The file is several MB, so it is built (tools/ci-tokenizer-json.sh) rather
than committed; tests/tokenizer.rs checks that it gives the same ids as the tiktoken fixtures.

Usage: python tools/make_tokenizer_json.py --vocab ../shared/reference/qwen3_6.tiktoken --out DIR
Dependencies: tools/requirements-fixtures.txt (no torch needed).
"""

import argparse
from pathlib import Path

from tokenizers import AddedToken
from transformers.convert_slow_tokenizer import TikTokenConverter
from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

from qwen_tokenizer_spec import ADDED_TOKENS, FIRST_ADDED_ID, SPLIT_PATTERN


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", required=True, type=Path, help="the .tiktoken rank file")
    parser.add_argument("--out", required=True, type=Path, help="directory to write tokenizer.json into")
    args = parser.parse_args()

    converter = TikTokenConverter(vocab_file=str(args.vocab), pattern=SPLIT_PATTERN)
    vocab, merges = converter.extract_vocab_merges_from_model(str(args.vocab))
    if len(vocab) != FIRST_ADDED_ID:
        raise SystemExit(f"{args.vocab}: expected {FIRST_ADDED_ID} tokens, found {len(vocab)}")

    tokenizer = Qwen3_5Tokenizer(vocab=vocab, merges=merges)
    # Added tokens are matched on the raw text (normalized=False), before NFC and BPE, as in
    # the published tokenizer.json. add_tokens keeps the given order, which fixes the ids.
    tokenizer.add_tokens(
        [
            AddedToken(text, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
            for text, special in ADDED_TOKENS
        ]
    )
    for i, (text, _) in enumerate(ADDED_TOKENS):
        got = tokenizer.convert_tokens_to_ids(text)
        if got != FIRST_ADDED_ID + i:
            raise SystemExit(f"{text} got id {got}, expected {FIRST_ADDED_ID + i}")

    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(args.out))
    print(f"wrote {args.out / 'tokenizer.json'} ({len(tokenizer)} tokens, {len(merges)} merges)")


if __name__ == "__main__":
    main()
