#!/usr/bin/env python3
"""Lane-level emulator of src/cuda/gemm_prefill.cu, to check its index math, swizzles, fragment
layouts, pipeline order and dequantisation bit tricks without a GPU.

It replays the kernel statement by statement for every block, warp and lane of a launch: the
row tables, cp.async copies into an emulated shared memory (same addresses and swizzles), the
{scale, bias} staging one k-tile ahead, ldmatrix.x4 and mma.m16n8k16 with the PTX ISA's fragment
layouts, the PRMT/IMAD/LOP3 dequantisation with bf16 rounding, and both epilogues; then compares
with numpy. Small shapes (it is slow): dense and grouped (gate_up SwiGLU + scattered down) for
Q4, Q8 and bf16, K from 128 (fewer k-tiles than stages) to 512 (steady state).

Keep it in step with gemm_prefill.cu when the kernel changes.

    python3 tools/emulate_gemm_prefill.py [seed] [dense|grouped|extra]   (needs numpy)
"""
import sys

import numpy as np

BM, BN, BK, WARPS = 64, 256, 64, 4
THREADS = 32 * WARPS
A_ROW_BYTES = BK * 2
A_BYTES = BM * A_ROW_BYTES
FMT = {"q4": (32, 4), "q8": (64, 4), "bf16": (128, 2)}

def bf16_bits(x):
    x = np.asarray(x, dtype=np.float32)
    b = x.view(np.uint32).astype(np.uint64)
    lsb = (b >> 16) & 1
    r = ((b + 0x7FFF + lsb) >> 16) & 0xFFFF
    return r.astype(np.uint16)

def bits_f32(b):
    return (np.asarray(b, dtype=np.uint32) << 16).view(np.float32)

def bf(x):  # round a python float to bf16, return float
    return float(bits_f32(bf16_bits(np.float32(x))))

def byte_perm(x, y, s):
    src = [(x >> (8 * i)) & 0xFF for i in range(4)] + [(y >> (8 * i)) & 0xFF for i in range(4)]
    r = 0
    for i in range(4):
        sel = (s >> (4 * i)) & 0x7  # (no sign replication: bit 3 of each selector is 0 here)
        assert (s >> (4 * i)) & 0x8 == 0
        r |= src[sel] << (8 * i)
    return r

def u32_to_pair(v):
    return float(bits_f32(v & 0xFFFF)), float(bits_f32((v >> 16) & 0xFFFF))

def pair_to_u32(lo, hi):
    return int(bf16_bits(np.float32(lo))) | (int(bf16_bits(np.float32(hi))) << 16)

def dequant_q4(w, sel, s2, b2):
    byte = byte_perm(w, 0, sel)
    both = (byte * 0x1001) & 0xFFFFFFFF
    m = (both & 0x000F000F) | 0x43004300
    mlo, mhi = u32_to_pair(m)
    s, _ = u32_to_pair(s2)
    b, _ = u32_to_pair(b2)
    assert u32_to_pair(s2)[0] == u32_to_pair(s2)[1] and u32_to_pair(b2)[0] == u32_to_pair(b2)[1]
    qlo, qhi = bf(mlo - 128.0), bf(mhi - 128.0)
    assert qlo == mlo - 128 and 0 <= qlo <= 15 and qlo == int(qlo)
    # fma.rn.bf16x2: exact product-sum, one rounding
    return pair_to_u32(bf(np.float64(qlo) * s + b), bf(np.float64(qhi) * s + b))

def dequant_q8(w, sel_lo, sel_hi, s, b):
    lo = float(np.float32(np.uint32(byte_perm(w, 0x4B000000, sel_lo)).view(np.float32)) - np.float32(8388608.0))
    hi = float(np.float32(np.uint32(byte_perm(w, 0x4B000000, sel_hi)).view(np.float32)) - np.float32(8388608.0))
    flo = float(np.float32(np.float64(lo) * s + b))  # fmaf: one fp32 rounding
    fhi = float(np.float32(np.float64(hi) * s + b))
    return pair_to_u32(flo, fhi)

def b_chunk(F, c, r):
    if F == "q4": return c
    if F == "q8": return c ^ ((r >> 1) & 3)
    return c ^ (r & 7)

def weight_row(E, r, col_tile, n):
    if E == "store":
        row = col_tile * BN + r
        return row if row < n else -1
    half = n // 2
    within = r & 63
    j = col_tile * (BN // 2) + (r >> 6) * 32 + (within & 31)
    if j >= half: return -1
    return j if within < 32 else half + j

class Smem:
    def __init__(self, n): self.b = bytearray(n)
    def u32(self, addr):
        assert addr % 4 == 0
        return int.from_bytes(self.b[addr:addr + 4], "little")
    def put(self, addr, data):
        assert addr % 16 == 0 and len(data) == 16
        self.b[addr:addr + 16] = data

def ldmatrix_x4(sm, addrs):  # addrs[lane] -> regs[lane][4]
    regs = [[0] * 4 for _ in range(32)]
    for T in range(32):
        for q in range(4):
            row_addr = addrs[8 * q + T // 4]
            assert row_addr % 16 == 0
            regs[T][q] = sm.u32(row_addr + 4 * (T % 4))
    return regs

def mma(acc, af, b0, b1):
    # acc[lane][4] float32, af[lane][4] u32, b0/b1[lane] u32
    A = np.zeros((16, 16)); B = np.zeros((16, 8))
    for T in range(32):
        g, t = T // 4, T % 4
        for q in range(4):
            lo, hi = u32_to_pair(af[T][q])
            r = g + 8 * (q & 1); c = 2 * t + 8 * (q >> 1)
            A[r, c], A[r, c + 1] = lo, hi
        lo, hi = u32_to_pair(b0[T]); B[2 * t, g], B[2 * t + 1, g] = lo, hi
        lo, hi = u32_to_pair(b1[T]); B[2 * t + 8, g], B[2 * t + 9, g] = lo, hi
    D = A @ B
    for T in range(32):
        g, t = T // 4, T % 4
        acc[T][0] += D[g, 2 * t]; acc[T][1] += D[g, 2 * t + 1]
        acc[T][2] += D[g + 8, 2 * t]; acc[T][3] += D[g + 8, 2 * t + 1]

def silu(v): return v / (1.0 + np.exp(-v))

def run_block(a, F, E, bx, by, y):
    ROW_BYTES, STAGES = FMT[F]
    QUANT = F != "bf16"
    CHUNKS = ROW_BYTES // 16
    B_BYTES = BN * ROW_BYTES
    SB_BYTES = BN * 4 if QUANT else 0
    STAGE = A_BYTES + B_BYTES + SB_BYTES
    sm = Smem(STAGES * STAGE)
    mat = 0
    if a["tiles"] is not None:
        if bx >= a["num_tiles"]: return
        tx = a["tiles"][bx]
        mat = min(max(tx[0], 0), a["count"] - 1); p0 = tx[1]; rows = min(tx[2], BM)
    else:
        p0 = bx * BM; rows = min(BM, a["x_rows"] - p0)
    col_tile = by
    bits = {"q4": 4, "q8": 8, "bf16": 16}[F]
    row_words = a["k"] * bits // 32
    ngroups = a["k"] // 64
    w_base = mat * a["w_mat_words"]
    a_row_s = [-1] * BM; c_row_s = [-1] * BM; b_off_s = [-1] * BN
    for r in range(BM):
        if r < rows:
            p = p0 + r
            xr = a["a_rows"][p] // a["a_div"] if a["a_rows"] is not None else p
            yr = a["c_rows"][p] if a["c_rows"] is not None else p
            a_row_s[r] = min(max(xr, 0), a["x_rows"] - 1)
            c_row_s[r] = min(max(yr, 0), a["y_rows"] - 1)
    sb_off = {}
    for tid in range(THREADS):
        sb_off[tid] = [-1, -1]
        for h in range(2):
            r = tid + h * THREADS
            row = weight_row(E, r, col_tile, a["n"])
            b_off_s[r] = -1 if row < 0 else row * row_words
            if row >= 0: sb_off[tid][h] = (mat * a["n"] + row) * ngroups
    X = a["x_bytes"]; W = a["w_bytes"]
    def load_tile(kt, s):
        sa = s * STAGE; sbase = s * STAGE + A_BYTES
        for tid in range(THREADS):
            for u in range(BM * 8 // THREADS):
                r = tid // 8 + u * (THREADS // 8); c = tid % 8
                xr = a_row_s[r]
                off = (max(xr, 0) * a["k"] + kt * BK + c * 8) * 2
                data = X[off:off + 16] if xr >= 0 else bytes(16)
                sm.put(sa + r * A_ROW_BYTES + ((c ^ (r & 7)) << 4), data)
            for u in range(BN * CHUNKS // THREADS):
                r = tid // CHUNKS + u * (THREADS // CHUNKS); c = tid % CHUNKS
                off_w = b_off_s[r]
                woff = (w_base + max(off_w, 0) + kt * (ROW_BYTES // 4) + c * 4) * 4
                data = W[woff:woff + 16] if off_w >= 0 else bytes(16)
                sm.put(sbase + r * ROW_BYTES + (b_chunk(F, c, r) << 4), data)
    def load_sb(kt):
        out = {}
        for tid in range(THREADS):
            v = []
            for h in range(2):
                o = sb_off[tid][h]
                v.append(0 if o < 0 else int(a["scales"][o + kt]) | (int(a["biases"][o + kt]) << 16))
            out[tid] = v
        return out
    def store_sb(s, vals):
        base = s * STAGE + A_BYTES + B_BYTES
        for tid in range(THREADS):
            sm.b[base + 4 * tid: base + 4 * tid + 4] = vals[tid][0].to_bytes(4, "little")
            sm.b[base + 4 * (tid + THREADS): base + 4 * (tid + THREADS) + 4] = vals[tid][1].to_bytes(4, "little")
    KT = a["k"] // BK
    pending = None
    for s in range(STAGES - 1):
        if s < KT:
            load_tile(s, s)
            if QUANT:
                pending = load_sb(s); store_sb(s, pending)
    if QUANT and STAGES - 1 < KT: pending = load_sb(STAGES - 1)
    # accs[warp][i][j][lane] = the lane's C fragment of m16 tile i, n8 tile j
    accs = [[[[[0.0] * 4 for _ in range(32)] for j in range(8)] for i in range(4)] for w in range(WARPS)]
    for kt in range(KT):
        nxt = kt + STAGES - 1
        if nxt < KT:
            if QUANT: store_sb(nxt % STAGES, pending)
            load_tile(nxt, nxt % STAGES)
        if QUANT and nxt + 1 < KT: pending = load_sb(nxt + 1)
        s = kt % STAGES
        sa = s * STAGE; sbm = s * STAGE + A_BYTES; sbb = s * STAGE + A_BYTES + B_BYTES
        for warp in range(WARPS):
            lanes = range(32)
            q_ = [l // 8 for l in lanes]; rr_ = [l % 8 for l in lanes]
            a_lane = [(rr_[l] + 8 * (q_[l] & 1)) * A_ROW_BYTES for l in lanes]
            a_hi = [q_[l] >> 1 for l in lanes]
            b_lane = [(warp * 64 + 8 * (q_[l] >> 1) + rr_[l]) * ROW_BYTES for l in lanes]
            b_hi = [q_[l] & 1 for l in lanes]
            g_ = [l // 4 for l in lanes]; t_ = [l % 4 for l in lanes]
            sel4 = [0x4440 | t_[l] for l in lanes]
            sel8lo = [0x7440 | (2 * (t_[l] & 1)) for l in lanes]
            sel8hi = [0x7440 | (2 * (t_[l] & 1) + 1) for l in lanes]
            s2 = [[0] * 8 for _ in lanes]; b2 = [[0] * 8 for _ in lanes]
            sf = [[0.0] * 8 for _ in lanes]; bfv = [[0.0] * 8 for _ in lanes]
            if QUANT:
                for l in lanes:
                    for j in range(8):
                        v = sm.u32(sbb + 4 * (warp * 64 + j * 8 + g_[l]))
                        if F == "q4":
                            s2[l][j] = byte_perm(v, 0, 0x1010); b2[l][j] = byte_perm(v, 0, 0x3232)
                        else:
                            sf[l][j] = float(np.uint32((v << 16) & 0xFFFFFFFF).view(np.float32))
                            bfv[l][j] = float(np.uint32(v & 0xFFFF0000).view(np.float32))
            for ks in range(4):
                af = []
                for i in range(4):
                    af.append(ldmatrix_x4(sm, [sa + a_lane[l] + i * 16 * A_ROW_BYTES + (((2 * ks + a_hi[l]) ^ rr_[l]) << 4) for l in lanes]))
                if F == "bf16":
                    for j in range(0, 8, 2):
                        bfr = ldmatrix_x4(sm, [sbm + b_lane[l] + j * 8 * ROW_BYTES + (((2 * ks + b_hi[l]) ^ rr_[l]) << 4) for l in lanes])
                        for i in range(4):
                            mma(accs[warp][i][j], af[i], [bfr[l][0] for l in lanes], [bfr[l][1] for l in lanes])
                            mma(accs[warp][i][j + 1], af[i], [bfr[l][2] for l in lanes], [bfr[l][3] for l in lanes])
                else:
                    for j in range(8):
                        b0 = [0] * 32; b1 = [0] * 32
                        for l in lanes:
                            row = warp * 64 + j * 8 + g_[l]
                            rowp = sbm + row * ROW_BYTES
                            if F == "q4":
                                base = rowp + (b_chunk("q4", ks // 2, row) << 4) + (ks % 2) * 8
                                wx, wy = sm.u32(base), sm.u32(base + 4)
                                b0[l] = dequant_q4(wx, sel4[l], s2[l][j], b2[l][j])
                                b1[l] = dequant_q4(wy, sel4[l], s2[l][j], b2[l][j])
                            else:
                                cw = rowp + (b_chunk("q8", ks, row) << 4)
                                b0[l] = dequant_q8(sm.u32(cw + 4 * (t_[l] // 2)), sel8lo[l], sel8hi[l], sf[l][j], bfv[l][j])
                                b1[l] = dequant_q8(sm.u32(cw + 4 * (2 + t_[l] // 2)), sel8lo[l], sel8hi[l], sf[l][j], bfv[l][j])
                        for i in range(4):
                            mma(accs[warp][i][j], af[i], b0, b1)
    # epilogue
    for warp in range(WARPS):
        for l in range(32):
            g, t = l // 4, l % 4
            for i in range(4):
                for h in range(2):
                    r = i * 16 + g + h * 8
                    if r >= rows: continue
                    if E == "store":
                        n = a["n"]
                        for j in range(8):
                            col = col_tile * BN + warp * 64 + j * 8 + 2 * t
                            for e in range(2):
                                if col + e < n:
                                    y[c_row_s[r], col + e] = bf(accs[warp][i][j][l][2 * h + e])
                    else:
                        half = a["n"] // 2
                        for j in range(4):
                            col = col_tile * (BN // 2) + warp * 32 + j * 8 + 2 * t
                            for e in range(2):
                                if col + e < half:
                                    gte = np.float32(accs[warp][i][j][l][2 * h + e]); up = np.float32(accs[warp][i][j + 4][l][2 * h + e])
                                    y[c_row_s[r], col + e] = bf(float(silu(gte) * up))

def make_weights(F, count, n, k, rng):
    """returns (w_bytes, scales_bits, biases_bits, W_deq[count][n][k] as float64 rounded to bf16 like the GPU)"""
    if F == "bf16":
        w = bf16_bits(rng.uniform(-0.05, 0.05, size=(count, n, k)).astype(np.float32))
        return w.tobytes(), None, None, bits_f32(w).astype(np.float64)
    bits = 4 if F == "q4" else 8
    codes = rng.integers(0, 1 << bits, size=(count, n, k), dtype=np.uint32)
    per = 32 // bits
    words = np.zeros((count, n, k // per), dtype=np.uint32)
    for i in range(per):
        words |= codes[:, :, i::per] << (bits * i)
    mx = (1 << bits) - 1
    s = rng.uniform(0.02, 0.06, size=(count, n, k // 64)) / mx * rng.choice([-1, 1], size=(count, n, k // 64))
    b = -s * mx / 2 + rng.uniform(-0.005, 0.005, size=s.shape)
    sb, bb = bf16_bits(s.astype(np.float32)), bf16_bits(b.astype(np.float32))
    sf = np.repeat(bits_f32(sb).astype(np.float64), 64, axis=2)
    bfl = np.repeat(bits_f32(bb).astype(np.float64), 64, axis=2)
    exact = codes * sf + bfl
    if F == "q4":
        deq = bits_f32(bf16_bits(exact.astype(np.float32))).astype(np.float64)  # fma then one bf16 rounding
    else:
        deq = bits_f32(bf16_bits(exact.astype(np.float32))).astype(np.float64)  # fmaf (fp32) then bf16
    return words.tobytes(), sb.ravel(), bb.ravel(), deq

def launch(F, E, Wb, sc, bi, count, n, k, X, x_rows, y_rows, a_rows=None, c_rows=None, tiles=None, num_tiles=0, a_div=1, positions=None):
    bits = {"q4": 4, "q8": 8, "bf16": 16}[F]
    a = dict(w_bytes=Wb, scales=sc, biases=bi, x_bytes=bf16_bits(X).tobytes(), a_rows=a_rows, c_rows=c_rows,
             tiles=tiles, num_tiles=num_tiles, w_mat_words=n * k * bits // 32, x_rows=x_rows, y_rows=y_rows,
             n=n, k=k, a_div=a_div, count=count)
    out_w = n if E == "store" else n // 2
    y = np.full((y_rows, out_w), np.nan)
    tiles_x = (positions + BM - 1) // BM if tiles is None else len(tiles)
    col_tiles = (n + BN - 1) // BN if E == "store" else (n // 2 + BN // 2 - 1) // (BN // 2)
    for bx in range(tiles_x):
        for by in range(col_tiles):
            run_block(a, F, E, bx, by, y)
    return y

def compare(what, got, want):
    assert not np.isnan(got).any(), f"{what}: unwritten outputs at {np.argwhere(np.isnan(got))[:5]}"
    err = np.abs(got - want)
    tol = np.abs(want) / 128 + 1e-3 * np.abs(want).max()
    bad = err > tol
    print(f"{what}: max err {err.max():.3e} (max |y| {np.abs(want).max():.3e}), bad {bad.sum()}")
    assert not bad.any(), np.argwhere(bad)[:10]

def dense(F, E, n, k, t, rng):
    Wb, sc, bi, deq = make_weights(F, 1, n, k, rng)
    X = bits_f32(bf16_bits(rng.uniform(-1, 1, size=(t, k)).astype(np.float32))).astype(np.float64)
    y = launch(F, E, Wb, sc, bi, 1, n, k, X.astype(np.float32), t, t, positions=t)
    ref = X @ deq[0].T
    if E == "swiglu":
        half = n // 2
        ref = silu(ref[:, :half]) * ref[:, half:]
    compare(f"dense {F} {E} n={n} k={k} t={t}", y, ref)

def grouped(F, count, n_gu, h, tokens, topk, rng):
    # ids, sorted pairs and tile map as the grouping kernels produce them
    ids = np.array([rng.choice(count, size=topk, replace=False) for _ in range(tokens)]).ravel()
    P = tokens * topk
    sorted_pairs, tiles = [], []
    for e in range(count):
        first = len(sorted_pairs)
        sorted_pairs += [p for p in range(P) if ids[p] == e]
        cnt = len(sorted_pairs) - first
        for i in range(0, cnt, BM):
            tiles.append((e, first + i, min(BM, cnt - i), 0))
    max_tiles = (P + BM - 1) // BM + min(count, P)
    ntiles = len(tiles)
    tiles += [(0, 0, 0, 0)] * (max_tiles - ntiles)
    Wgu, sgu, bgu, dgu = make_weights(F, count, n_gu, h, rng)
    inter = n_gu // 2
    Wd, sd, bd, dd = make_weights(F, count, h, inter, rng)
    X = bits_f32(bf16_bits(rng.uniform(-1, 1, size=(tokens, h)).astype(np.float32))).astype(np.float64)
    act = launch(F, "swiglu", Wgu, sgu, bgu, count, n_gu, h, X.astype(np.float32), tokens, P,
                 a_rows=sorted_pairs, tiles=tiles, num_tiles=ntiles, a_div=topk)
    ref_act = np.zeros((P, inter))
    for pos, p in enumerate(sorted_pairs):
        e = ids[p]; v = dgu[e] @ X[p // topk]
        ref_act[pos] = silu(v[:inter]) * v[inter:]
    compare(f"grouped {F} gate_up", act, ref_act)
    routed = launch(F, "store", Wd, sd, bd, count, h, inter, act.astype(np.float32), P, P,
                    c_rows=sorted_pairs, tiles=tiles, num_tiles=ntiles)
    ref_r = np.zeros((P, h))
    for pos, p in enumerate(sorted_pairs):
        ref_r[p] = dd[ids[p]] @ act[pos]
    compare(f"grouped {F} down", routed, ref_r)

def main():
    rng = np.random.default_rng(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    which = sys.argv[2] if len(sys.argv) > 2 else "all"
    for F in ["q4", "q8", "bf16"]:
        if which in ("all", "dense"):
            dense(F, "store", 300, 128, 70, rng)
            dense(F, "swiglu", 2 * 144, 192, 20, rng)
        if which in ("all", "grouped"):
            grouped(F, 5, 2 * 64, 128, 20, 3, rng)

def extra(rng):
    for F in ["q4", "q8", "bf16"]:
        dense(F, "store", 260, 512, 65, rng)          # KT = 8 > STAGES: the steady-state pipeline
    grouped("q4", 4, 2 * 64, 320, 80, 3, rng)         # experts with 2 tiles (rows > 64); one expert empty

if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[2] == "extra":
        extra(np.random.default_rng(int(sys.argv[1])))
    else:
        main()
