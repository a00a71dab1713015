#!/usr/bin/env python3
"""Checks make_gguf.py against llama.cpp's own converter, on the CPU, for the tiny config.

1. transformers writes a random tiny qwen3_5_moe checkpoint (real vocabulary size, no MTP) with the
   real Qwen3.6 tokenizer.json beside it;
2. llama.cpp's convert_hf_to_gguf.py converts it (bf16);
3. make_gguf.py writes the same config;
4. every metadata key and value (tokenizer included) and every tensor name and shape must agree;
   only the names, the file type and the tensor types may differ (make_gguf quantises);
5. with --llama-bench, llama-bench must load and run make_gguf's file.

Usage: python check_gguf.py --llama-src DIR --tokenizer-dir DIR [--llama-bench BIN] [--work DIR]
Needs torch, transformers (tools/peers/README.md says which versions).
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import model_config  # noqa: E402

MAY_DIFFER = {"general.name", "general.size_label", "general.file_type", "general.type"}


def write_hf_checkpoint(out, tokenizer_dir):
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    c = model_config.get("tiny", vocab_size=model_config.FULL["vocab_size"])
    c["bos_token_id"] = c["eos_token_id"] = model_config.FULL["eos_token_id"]
    model = Qwen3_5MoeForCausalLM._from_config(Qwen3_5MoeTextConfig(**c), dtype=torch.bfloat16)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)


def read(path, gguf):
    r = gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: ([int(x) for x in t.shape], t.tensor_type.name) for t in r.tensors}
    return fields, tensors


def compare(reference, made, gguf):
    ref_fields, ref_tensors = read(reference, gguf)
    got_fields, got_tensors = read(made, gguf)
    problems = []
    for key in sorted(set(ref_fields) | set(got_fields)):
        if key in MAY_DIFFER:
            continue
        if key not in got_fields:
            problems.append(f"missing key {key}")
        elif key not in ref_fields:
            problems.append(f"extra key {key}")
        elif ref_fields[key] != got_fields[key]:
            a, b = ref_fields[key], got_fields[key]
            problems.append(f"key {key}: converter {str(a)[:80]} vs make_gguf {str(b)[:80]}")
    for name in sorted(set(ref_tensors) | set(got_tensors)):
        if name not in got_tensors:
            problems.append(f"missing tensor {name}")
        elif name not in ref_tensors:
            problems.append(f"extra tensor {name}")
        elif ref_tensors[name][0] != got_tensors[name][0]:
            problems.append(f"tensor {name}: shape {ref_tensors[name][0]} vs {got_tensors[name][0]}")
        elif ref_tensors[name][1] in ("F32",) and got_tensors[name][1] != "F32":
            problems.append(f"tensor {name}: converter keeps F32, make_gguf wrote {got_tensors[name][1]}")
    types = {}
    for name, (_, t) in got_tensors.items():
        types[t] = types.get(t, 0) + 1
    return problems, len(ref_fields), len(ref_tensors), types


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-src", required=True, type=Path)
    parser.add_argument("--tokenizer-dir", required=True, type=Path,
                        help="tokenizer.json and tokenizer_config.json, as tools/make_tokenizer_json.py writes them")
    parser.add_argument("--llama-bench", type=Path)
    parser.add_argument("--work", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(args.llama_src / "gguf-py"))
    import gguf

    work = args.work or Path(tempfile.mkdtemp(prefix="check-gguf-"))
    hf = work / "hf-tiny"
    hf.mkdir(parents=True, exist_ok=True)
    write_hf_checkpoint(hf, args.tokenizer_dir)
    env = {"PYTHONPATH": str(args.llama_src / "gguf-py")}
    converted, made = work / "converted.gguf", work / "made.gguf"
    subprocess.run([sys.executable, str(args.llama_src / "convert_hf_to_gguf.py"), str(hf), "--outtype", "bf16",
                    "--no-mtp", "--outfile", str(converted)], check=True, env={**os.environ, **env},
                   stdout=subprocess.DEVNULL)
    subprocess.run([sys.executable, str(HERE / "make_gguf.py"), "--gguf-py", str(args.llama_src / "gguf-py"),
                    "--tokenizer", str(args.tokenizer_dir / "tokenizer.json"), "--out", str(made), "--config", "tiny"], check=True)
    problems, n_keys, n_tensors, types = compare(converted, made, gguf)
    print(f"compared {n_keys} metadata keys and {n_tensors} tensors with convert_hf_to_gguf.py's output; "
          f"make_gguf's tensor types: {types}")
    for p in problems:
        print("  MISMATCH", p)
    if problems:
        raise SystemExit(f"{len(problems)} mismatches")
    if args.llama_bench:
        cmd = [str(args.llama_bench), "-m", str(made), "-p", "64", "-n", "8", "-r", "1", "-t", "2", "-o", "md"]
        print("$", " ".join(cmd))
        subprocess.run(cmd, check=True)
    print("ok")


if __name__ == "__main__":
    main()
