#!/usr/bin/env python3
"""Writes tests/fixtures/tokenizer/corpus.json: corpus strings and the token ids that Python tiktoken
gives for them with the Qwen3.6 vocabulary.

The reference tokenizer (transformers' Qwen3_5Tokenizer, a Hugging Face `tokenizers` pipeline) first
cuts the 33 added tokens out of the raw text as whole strings, then NFC-normalises each remaining
piece, splits it with the pre-tokenizer regex and runs byte-level BPE. We do the same here with
tiktoken doing the regex split and the BPE. tools/make_tokenizer_json.py builds the transformers
tokenizer itself, and tests/tokenizer.rs checks that it gives these same ids.

Usage: python tools/make_tokenizer_fixtures.py [--vocab ../shared/reference/qwen3_6.tiktoken]
Dependencies: tools/requirements-fixtures.txt.
"""

import argparse
import hashlib
import json
import random
import re
import unicodedata
from pathlib import Path

import tiktoken

from qwen_tokenizer_spec import ADDED_TOKENS, FIRST_ADDED_ID, SPLIT_PATTERN, load_ranks

ROOT = Path(__file__).resolve().parent.parent
SPECIALS = {text: FIRST_ADDED_ID + i for i, (text, _) in enumerate(ADDED_TOKENS)}

ENGLISH = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "It's a truth universally acknowledged, that a single man in possession of a good fortune must be in want of a wife.",
    "I'm sure they'll say we'd've done it, but you're wrong and he's right.",
    "DON'T SHOUT. I'LL HEAR YOU'RE HERE, WE'VE SEEN IT'S TRUE.",
    "Don'T mIxEd CaSe'S",
    "rock 'n' roll, 'quoted', \"double quoted\", `backticks`",
    "e.g. i.e. etc. Mr. Smith vs. Dr. Jones",
    "Wait... what?! No way!!! (Really?) [Yes.] {Maybe}",
    "email: someone@example.com, url: https://example.org/path?q=1&r=two#frag",
    "snake_case camelCase PascalCase kebab-case SCREAMING_SNAKE",
    "antidisestablishmentarianism pneumonoultramicroscopicsilicovolcanoconiosis",
    " leading space",
    "trailing space ",
    "  two leading spaces",
    "a",
    " ",
    "A",
    "user",
    "assistant",
    "system",
    "\n",
    "Tokenization is the first step of every request.",
    "Numbers like 3.14159, 2,718 and -42 appear; so do 1e-9 and 0x1F.",
    "Dates: 2024-01-31, 31/01/2024, 12:30:45.123Z",
    "Price: $19.99 (€17,50; £15) — 20% off!",
    "Ellipsis… en–dash — em—dash “curly quotes” ‘single’ «guillemets»",
    "THE END",
    "Tab\tseparated\tvalues\there",
    "Line one\nLine two\n\nLine four",
]

CJK = [
    "你好，世界！",
    "我爱北京天安门。",
    "机器学习是人工智能的一个分支，它使计算机能够从数据中学习。",
    "今天天气很好，我们去公园散步吧。",
    "日本語のテキストも正しく扱えるはずです。",
    "ひらがな カタカナ 漢字 ｶﾀｶﾅ",
    "東京は日本の首都です。",
    "안녕하세요, 세계!",
    "한국어 문장도 토큰화됩니다.",
    "中文English混合text测试",
    "繁體中文與简体中文",
    "「引用」『二重』【括弧】〈山括弧〉",
    "全角スペース\u3000の後",
    "１２３４５ＡＢＣ",
    "ありがとう、ございます。",
    "𠀀𠀁𠀂 (CJK extension B)",
    "龘靐齉爩",
    "漢字の読み方：かんじ",
    "第1章　はじめに",
    "北京2024年奥运会",
]

SCRIPTS = [
    "مرحبا بالعالم",
    "اللغة العربية جميلة جداً.",
    "السَّلَامُ عَلَيْكُمْ",
    "١٢٣٤٥٦٧٨٩٠",
    "שָׁלוֹם עוֹלָם",
    "नमस्ते दुनिया",
    "हिन्दी भाषा में वाक्य।",
    "क़ ख़ ग़ ज़",
    "क्षत्रिय ज्ञान श्री",
    "Здравствуй, мир!",
    "Съешь же ещё этих мягких французских булок.",
    "Γειά σου Κόσμε",
    "ΆΈΉΊΌΎΏ άέήίόύώ",
    "Tiếng Việt có nhiều dấu: ầ ẩ ẫ ấ ậ",
    "ภาษาไทย สวัสดีครับ",
    "தமிழ் மொழி",
    "ქართული ენა",
    "Հայերեն լեզու",
    "ᚠᚢᚦᚨᚱᚲ runes",
    "Ελληνικά και English και русский",
    "Ünïcödé Çàfé naïve façade résumé",
    "Straße Größe Maß",
    "ﬁ ﬂ ﬀ ligatures",
    "Ⅻ Ⅷ ⅷ roman numerals",
    "½ ¼ ¾ ² ³ ¹",
    "∑ ∫ √ ∞ ≠ ≤ ≥ ∀ ∃",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕸𝖆𝖙𝖍",
    "ʻOkina and ʼapostrophe",
    "Ｆｕｌｌｗｉｄｔｈ",
    "Zalgo: Z̷̡̛a̶̛l̴g̸o̵",
]

EMOJI = [
    "😀",
    "😀😃😄😁",
    "I love 🍕 and 🍣!",
    "👍🏽 thumbs up, medium skin tone",
    "👨‍👩‍👧‍👦 family",
    "👩🏾‍💻 woman technologist",
    "🏳️‍🌈 rainbow flag",
    "🏴‍☠️ pirate flag",
    "🇺🇸🇬🇧🇯🇵🇨🇳 flags",
    "1️⃣ 2️⃣ #️⃣ *️⃣ keycaps",
    "❤️ vs ❤ (with and without VS16)",
    "🧑‍🤝‍🧑",
    "👁️‍🗨️",
    "🫶🏼🫠🥹",
    "emoji at end 🎉",
    "🎉 emoji at start",
    "text🙂text",
    "🏴󠁧󠁢󠁳󠁣󠁴󠁿 Scotland",
    "☕️ coffee",
    "🤷‍♀️🤷‍♂️",
]

# Strings whose NFC form differs from the input, or which sit at the edges of NFC.
COMBINING = [
    "e\u0301",
    "cafe\u0301",
    "caf\u00e9 vs cafe\u0301",
    "A\u030a",
    "\u212b Angstrom sign",
    "\u212a Kelvin sign",
    "\u2126 Ohm sign",
    "question\u037e",
    "o\u0308\u0304",
    "q\u0307\u0323",
    "a\u0323\u0302",
    "\u1e0b\u0323",
    "\u0301 leading combining mark",
    "\u0301\u0302\u0303",
    "n\u0303o\u0303",
    "\u1100\u1161\u11a8",
    "\u1112\u1161\u11ab\u1100\u1173\u11af",
    "\u0958\u0959\u095a",
    "\u0915\u093c",
    "\u0627\u0653",
    "\u05e9\u05c1\u05bc",
    "\u0e40\u0e01\u0e49\u0e32",
    "<\u0338 and >\u0338 and =\u0338",
    "\u226e already composed",
    "i\u0307",
    "\u00c5\u0301",
    "U\u0308\u0301",
    "\u01d7",
    "\u1e9b\u0323",
    "x\u0336\u0336",
]

CODE = [
    "def f(x):\n    return x * 2\n",
    "import numpy as np\n\nclass Foo(Bar):\n    def __init__(self, *args, **kwargs):\n        super().__init__()\n",
    "fn main() {\n    let v: Vec<u32> = (0..10).collect();\n    println!(\"{:?}\", v);\n}\n",
    "impl<'a, T: Clone + 'a> Iterator for Iter<'a, T> {\n\ttype Item = &'a T;\n}",
    "for (int i = 0; i < n; ++i) { a[i] += b[i] * c; }",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); return 0; }",
    "const add = (a, b) => a + b;\nconsole.log(`sum: ${add(1, 2)}`);",
    "package main\n\nimport \"fmt\"\n\nfunc main() {\n\tfmt.Println(\"hi\")\n}\n",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC LIMIT 10;",
    "<!DOCTYPE html>\n<html><body><div class=\"x\">Hi &amp; bye</div></body></html>",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null, \"b\": true}}",
    "#!/bin/bash\nset -euo pipefail\nfor f in *.txt; do echo \"$f\"; done\n",
    "x = [i**2 for i in range(10) if i % 2 == 0]",
    "  if (x) {\n    y();\n  } else {\n    z();\n  }",
    "// comment\n/* block\n * comment */\n",
    "a:=b||c&&d!=e<=f>>g<<h",
    "public static void main(String[] args) throws Exception {}",
    "matrix = [[1, 0], [0, 1]]\nprint(matrix @ matrix)",
    "\\begin{equation} E = mc^2 \\end{equation}",
    "git commit -m 'fix: handle \\r\\n line endings'",
    "```python\nprint('hello')\n```",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    "    indented with four spaces",
    "\tindented with a tab",
    "key: value\nlist:\n  - item1\n  - item2\n",
]

WHITESPACE = [
    "a\r\nb",
    "line1\r\nline2\r\n",
    "\r\n\r\n",
    "\r",
    "\r\r\n\n",
    "a\n\n\nb",
    "a \n b",
    "  \n  ",
    "\t\t\t",
    " \t \t ",
    "end with newline\n",
    "\n\n\n\n\n\n\n\n",
    "word  word   word    word",
    "a\u00a0b non-breaking space",
    "a\u2028b line separator",
    "a\u2029b paragraph separator",
    "a\u200bb zero width space",
    "a\u2003b em space",
    "\u3000\u3000ideographic",
    "\ufeffBOM at start",
    "x" + " " * 17 + "y",
    " " * 100,
    " " * 1000 + "x",
    "\n" * 50 + "end",
    "\t" * 40,
    "  \t\n" * 30,
    "a" + "\r\n" * 20,
    " " * 5000,
    "word\u0085next",
    "\x0b vertical tab \x0c form feed",
]

DIGITS = [
    "0",
    "1234567890",
    "12345678901234567890123456789012345678901234567890",
    "3.14159265358979",
    "1,000,000.00",
    "-273.15°C",
    "+1 (555) 123-4567",
    "v1.2.3-beta.4",
    "0b1010 0o777 0xDEADBEEF",
    "٠١٢٣ ۴۵۶ ߀߁",
    "१२३४ ০১২৩",
    "１２３",
    "²³¹⁴ ₀₁₂",
    "①②③ ⑴⑵",
    "2^10 = 1024",
    "100%",
    "3rd 21st 42nd",
    "a1b2c3",
    "99 bottles",
    "IPv4 192.168.0.1, IPv6 ::1",
]


def special_cases():
    """Every added token: alone, inside text, back to back, and near-misses that must stay text."""
    cases = []
    for text, _ in ADDED_TOKENS:
        cases.append(text)
        cases.append(f"before {text} after")
        cases.append(f"x{text}y")
    cases.append("".join(text for text, _ in ADDED_TOKENS))
    cases += [
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n",
        "<|im_start|>assistant\n<think>\n",
        "<|im_start|>assistant\n<think>\n\n</think>\n\nHello there.<|im_end|>",
        "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>\n",
        "<|vision_start|><|image_pad|><|vision_end|>Describe the picture.",
        "<|fim_prefix|>def f():\n<|fim_suffix|>\n    return 1<|fim_middle|>",
        "<|repo_name|>lily<|file_sep|>src/lib.rs\npub mod tokenizer;",
        "<|im_end|",
        "|im_end|>",
        "<|im_end",
        "< |im_end|>",
        "<|IM_END|>",
        "<THINK>",
        "<think",
        "think>",
        "< think>",
        "<<|im_end|>>",
        "<<think>>",
        "<|im_start|><|im_start|><|im_start|>",
        "<|endoftext|><|endoftext|>",
        "</think></think>",
        "<tts_text_bos><tts_text_bos_single>",
        "<tts_text_bos_singl>",
        "<|im_end|>\u0338",
        "<\u0338|im_end|>",
        "\u0301<|im_end|>\u0301",
        "e<|im_end|>\u0301",
        "<|im_end|>\u212a",
        "  <|im_start|>  ",
        "\n<think>\n",
        "<think>\n\n</think>\n\n",
    ]
    return cases


def mixed_cases(rng, pools, count):
    """Deterministic random mixtures of fragments from every pool, joined by assorted separators."""
    fragments = [s for pool in pools for s in pool if len(s) < 200]
    separators = ["", " ", "\n", "\r\n", "\t", "  ", ", ", " <|im_end|> ", "<think>", "\n\n"]
    cases = []
    for _ in range(count):
        parts = rng.sample(fragments, rng.randint(2, 5))
        text = parts[0]
        for part in parts[1:]:
            text += rng.choice(separators) + part
        cases.append(text)
    return cases


def build_corpus():
    pools = [ENGLISH, CJK, SCRIPTS, EMOJI, COMBINING, CODE, WHITESPACE, DIGITS]
    corpus = [""]
    for pool in pools:
        corpus += pool
    corpus += special_cases()
    corpus += mixed_cases(random.Random(20260), pools + [special_cases()], 120)
    # Keep the first occurrence of each string, in order.
    return list(dict.fromkeys(corpus))


def encode(enc, text):
    """Added tokens as whole strings first; NFC and BPE on the text between them."""
    special_re = "(" + "|".join(re.escape(t) for t in SPECIALS) + ")"
    ids = []
    for i, part in enumerate(re.split(special_re, text)):
        if i % 2 == 1:
            ids.append(SPECIALS[part])
        else:
            ids += enc.encode_ordinary(unicodedata.normalize("NFC", part))
    return ids


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", default=ROOT.parent / "shared/reference/qwen3_6.tiktoken", type=Path)
    parser.add_argument("--out", default=ROOT / "tests/fixtures/tokenizer/corpus.json", type=Path)
    args = parser.parse_args()

    ranks = load_ranks(args.vocab)
    enc = tiktoken.Encoding(
        name="qwen3_6",
        pat_str=SPLIT_PATTERN,
        mergeable_ranks=ranks,
        special_tokens=SPECIALS,
    )
    cases = []
    for text in build_corpus():
        ids = encode(enc, text)
        case = {"text": text, "ids": ids}
        decoded = enc.decode(ids, errors="strict")
        if decoded != text:
            case["decoded"] = decoded  # NFC changed the text
        cases.append(case)

    fixture = {
        "about": "Token ids of Python tiktoken for the Qwen3.6 vocabulary; written by tools/make_tokenizer_fixtures.py",
        "vocab_sha256": hashlib.sha256(args.vocab.read_bytes()).hexdigest(),
        "tiktoken_version": tiktoken.__version__,
        "unicode_version": unicodedata.unidata_version,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # One case per line keeps the file small and its diffs readable.
    header = json.dumps(fixture, ensure_ascii=False, indent=1)[: -len("\n}")]
    body = ",\n".join(json.dumps(case, ensure_ascii=False) for case in cases)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(f'{header},\n "cases": [\n{body}\n ]\n}}\n')
    print(f"wrote {len(cases)} cases to {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
