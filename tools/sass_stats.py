#!/usr/bin/env python3
"""What the CUDA kernels compile to, without a GPU: per kernel the SASS instruction count, registers
and spills (ptxas), IEEE slow-path calls (an IEEE division or square root adds a CALL and a
branch at each use), and with --loops each loop's length and commonest opcodes.

A session that has no GPU time left can still predict and check a change by its code: fewer
instructions in a k-loop, no global load left in it, no new spills, a body that fits the
instruction cache (bench/NOTES.md v1.44). Needs nvcc (scripts/setup-cuda.sh) and nvdisasm
(WITH_SASS=1 scripts/setup-cuda.sh); the flags are build.rs's.

    python3 tools/sass_stats.py [--loops] [--kernel REGEX] src/cuda/gemm_wgmma.cu ...
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ["-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-O3", "-std=c++17", "-Xptxas=-v"]
LOOP_MIN_INSTRUCTIONS = 64  # shorter backward branches are inner helper loops, not kernel loops


def tool(name, env):
    """nvcc / nvdisasm: $NVCC's folder, else the repo's .venv-cuda (setup-cuda.sh installs both there)."""
    if env in os.environ:
        path = Path(os.environ[env])
        return path if name == "nvcc" else path.with_name(name)
    found = sorted(ROOT.glob(f".venv-cuda/lib/python3*/site-packages/nvidia/cu13/bin/{name}"))
    if not found:
        sys.exit(f"sass_stats: no {name}; run {'WITH_SASS=1 ' if name == 'nvdisasm' else ''}scripts/setup-cuda.sh")
    return found[0]


def ptxas_info(log):
    """Kernel → (registers, spill stores, spill loads) from ptxas -v output."""
    info, kernel, spills = {}, None, (0, 0)
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            kernel, spills = m.group(1), (0, 0)
        elif m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line):
            spills = (int(m.group(1)), int(m.group(2)))
        elif kernel and (m := re.search(r"Used (\d+) registers", line)):
            info[kernel] = (int(m.group(1)), *spills)
    return info


def functions(sass):
    """Kernel → [(address, instruction text)] from nvdisasm -c output."""
    out, name = {}, None
    for line in sass.splitlines():
        if m := re.match(r"\s*\.text\.(\w+):", line):
            name = m.group(1)
            out[name] = []
        elif name and (m := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)):
            out[name].append((int(m.group(1), 16), re.sub(r"\s+", " ", m.group(2))))
    return out


def opcode(ins):
    return re.sub(r"^@!?U?P\w+ ", "", ins).split()[0].split(".")[0]


def loops(code, labels):
    """(start, end, instructions) of each backward branch spanning at least LOOP_MIN_INSTRUCTIONS.
    Branches after the kernel's last EXIT belong to the slow-path subroutines placed behind it
    (their returns into the body are no loops) and are skipped."""
    found = []
    exits = [a for a, ins in code if opcode(ins) == "EXIT"]
    body_end = exits[-1] if exits else code[-1][0]
    for i, (addr, ins) in enumerate(code):
        if addr > body_end:
            break
        m = re.search(r"BRA (?:!?U?P\w+, )?`?\(?(\.L_x_\d+|0x[0-9a-f]+)", ins)
        if not m:
            continue
        target = labels.get(m.group(1)) if m.group(1).startswith(".L") else int(m.group(1), 16)
        if target is not None and target < addr:
            body = [x for a, x in code if target <= a <= addr]
            if len(body) >= LOOP_MIN_INSTRUCTIONS:
                found.append((target, addr, body))
    return found


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sources", nargs="+", type=Path)
    p.add_argument("--kernel", default=".", help="regex: only kernels whose name matches")
    p.add_argument("--loops", action="store_true", help="each loop's length and commonest opcodes")
    args = p.parse_args()
    nvcc, nvdisasm = tool("nvcc", "NVCC"), tool("nvdisasm", "NVCC")
    for src in args.sources:
        with tempfile.TemporaryDirectory() as tmp:
            cubin = Path(tmp) / "k.cubin"
            r = subprocess.run([nvcc, *FLAGS, "-I", str(ROOT / "src/cuda"), "-o", cubin, src],
                               capture_output=True, text=True)
            if r.returncode:
                sys.exit(f"nvcc failed on {src}:\n{r.stderr}")
            info = ptxas_info(r.stderr + r.stdout)
            sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
        # Label → address, for the branch targets nvdisasm writes as labels.
        labels, pending = {}, []
        for line in sass.splitlines():
            if m := re.match(r"\s*(\.L_x_\d+):", line):
                pending.append(m.group(1))
            elif pending and (m := re.match(r"\s*/\*([0-9a-f]{4,})\*/", line)):
                labels.update({lab: int(m.group(1), 16) for lab in pending})
                pending = []
        for name, code in sorted(functions(sass).items()):
            if not re.search(args.kernel, name):
                continue
            regs, st, ld = info.get(name, (0, 0, 0))
            calls = sum(opcode(i) == "CALL" for _, i in code)
            print(f"{src.name} {name}: {len(code)} instructions, {regs} registers, spills {st}/{ld} bytes, "
                  f"{calls} slow-path calls")
            if args.loops:
                for start, end, body in loops(code, labels):
                    top = Counter(opcode(i) for i in body).most_common(10)
                    print(f"    loop {start:#06x}–{end:#06x}: {len(body)} instructions; "
                          + ", ".join(f"{k} {v}" for k, v in top))


if __name__ == "__main__":
    main()
