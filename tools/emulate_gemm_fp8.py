#!/usr/bin/env python3
"""Lane-level emulator of src/cuda/gemm_fp8.cu (the FP8 prefill products), to check its index math
without a GPU: the per-thread copy sources and swizzled destinations of each stage, the token and
weight scales' copies, wgmma m64nNk32's operands (A and B through K-major 128-byte-swizzled
descriptors advanced 32 bytes per k32 step),
the per-k-tile promotion and both epilogues, for dense and grouped launches; then compares with
numpy. The e4m3 values are decoded exactly; products are summed in float64 (the emulator checks
indices, not the tensor cores' rounding).

Keep it in step with gemm_fp8.cu when the kernel changes.

    python3 tools/emulate_gemm_fp8.py [seed]   (needs numpy)
"""
import sys

import numpy as np

BM, BN, BK, QBLOCK, THREADS, STAGES = 128, 128, 128, 128, 256, 6
X_BYTES = BM * BK
W_OFF = X_BYTES
XS_OFF = W_OFF + BN * BK
WS_OFF = XS_OFF + BM * 4
STAGE_BYTES = (WS_OFF + 16 + 1023) // 1024 * 1024
STORE, SWIGLU = 0, 1


def e4m3_table():
    t = np.zeros(256, dtype=np.float64)
    for b in range(256):
        e, m = (b >> 3) & 15, b & 7
        v = np.nan if (e == 15 and m == 7) else (m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
        t[b] = -v if b & 0x80 else v
    return t


E4M3 = e4m3_table()


def weight_row(E, r, col_tile, n):
    if E == STORE:
        row = col_tile * BN + r
        return row if row < n else -1
    half, j = n // 2, col_tile * (BN // 2) + (r // 16) * 8 + (r % 8)
    if j >= half:
        return -1
    return j if r % 16 < 8 else half + j


def silu(v):
    return v / (1.0 + np.exp(-v))


class Launch:
    def __init__(self, wq, ws, xq, xs, n, k, x_rows, y_rows, count, tiles=None, a_rows=None, c_rows=None, a_div=1):
        self.wq, self.ws, self.xq, self.xs = wq.reshape(-1), ws.reshape(-1), xq.reshape(-1), xs.reshape(-1)
        self.n, self.k, self.x_rows, self.y_rows, self.count = n, k, x_rows, y_rows, count
        self.tiles, self.a_rows, self.c_rows, self.a_div = tiles, a_rows, c_rows, a_div

    def block_tile(self, bx, positions):
        if self.tiles is not None:
            if bx >= len(self.tiles):
                return None
            mat, p0, rows = self.tiles[bx]
            return min(max(mat, 0), self.count - 1), p0, min(rows, BM)
        return 0, bx * BM, min(BM, self.x_rows - bx * BM)

    def token_rows(self, p0, rows):
        a_row, c_row = [-1] * BM, [-1] * BM
        for r in range(rows):
            p = p0 + r
            xr = self.a_rows[p] // self.a_div if self.a_rows is not None else p
            yr = self.c_rows[p] if self.c_rows is not None else p
            a_row[r] = min(max(xr, 0), self.x_rows - 1)
            c_row[r] = min(max(yr, 0), self.y_rows - 1)
        return a_row, c_row


def cp_async(smem, dst, src_arr, src, size, valid):
    smem[dst:dst + size] = src_arr[src:src + size] if valid else 0


def run(E, L, y, blocks_x, positions):
    n, k = L.n, L.k
    kb = k // BK
    col_tiles = (n // 2 + BN // 2 - 1) // (BN // 2) if E == SWIGLU else (n + BN - 1) // BN
    for by in range(col_tiles):
        for bx in range(blocks_x):
            t = L.block_tile(bx, positions)
            if t is None:
                continue
            mat, p0, rows = t
            a_row_s, c_row_s = L.token_rows(p0, rows)
            block(E, L, y, mat, rows, by, a_row_s, c_row_s, kb)


def block(E, L, y, mat, rows, col_tile, a_row_s, c_row_s, kb):
    n, k = L.n, L.k
    N = 128 if rows > 64 else 64
    X_CHUNKS, W_CHUNKS = N * (BK // 16) // THREADS, BN * (BK // 16) // THREADS
    wbase = mat * n * k
    # Each thread's copies, as the kernel sets them up (byte offsets into the flat arrays).
    plan = []
    for tid in range(THREADS):
        c, r0 = tid % 8, tid // 8
        x_src = []
        for u in range(X_CHUNKS):
            xr = a_row_s[r0 + 32 * u]
            x_src.append((xr >= 0, max(xr, 0) * k + c * 16))
        w_src = []
        for u in range(W_CHUNKS):
            wr = weight_row(E, r0 + 32 * u, col_tile, n)
            w_src.append((wr >= 0, wbase + max(wr, 0) * k + c * 16))
        chunk_dst = r0 * 128 + ((c ^ (r0 & 7)) << 4)
        xs_row = a_row_s[tid] if tid < N else -1
        xs_src = max(xs_row, 0) * kb
        ws_ok, ws_src = False, 0
        if tid >= THREADS - 2:
            h = tid - (THREADS - 2)
            row = weight_row(E, 8 if (E == SWIGLU and h == 1) else 0, col_tile, n)
            ws_ok = row >= 0
            ws_src = (mat * ((n + QBLOCK - 1) // QBLOCK) + max(row, 0) // QBLOCK) * kb
        plan.append((x_src, w_src, chunk_dst, xs_row, xs_src, ws_ok, ws_src))

    stages = [np.zeros(STAGE_BYTES, dtype=np.uint8) for _ in range(STAGES)]
    xs_bytes = L.xs.astype(np.float32).view(np.uint8)
    ws_bytes = L.ws.astype(np.float32).view(np.uint8)

    def load_tile(kt, s):
        st = stages[s]
        for tid, (x_src, w_src, chunk_dst, xs_row, xs_src, ws_ok, ws_src) in enumerate(plan):
            for u, (ok, src) in enumerate(x_src):
                cp_async(st, chunk_dst + u * 32 * 128, L.xq, src + kt * BK, 16, ok)
            for u, (ok, src) in enumerate(w_src):
                cp_async(st, W_OFF + chunk_dst + u * 32 * 128, L.wq, src + kt * BK, 16, ok)
            if tid < N:
                cp_async(st, XS_OFF + tid * 4, xs_bytes, (xs_src + kt) * 4, 4, xs_row >= 0)
            if tid >= THREADS - 2:
                cp_async(st, WS_OFF + (tid - (THREADS - 2)) * 4, ws_bytes, (ws_src + kt) * 4, 4, ws_ok)

    d = np.zeros((8, 32, N // 2))  # [warp][lane][accumulator]
    for kt in range(kb):
        load_tile(kt, kt % STAGES)  # the pipeline's order does not change what a stage holds
        st = stages[kt % STAGES]
        acc = np.zeros((8, 32, N // 2))
        for wg in range(2):
            # A: the warpgroup's 64 weight rows through the descriptor (rows 64wg.. of the weight
            # tile, the same swizzle as X): step s reads bytes 32s.. of each row.
            A = np.zeros((64, BK))
            for s in range(4):
                for m in range(64):
                    r = 64 * wg + m
                    for kk in range(32):
                        byte = 32 * s + kk
                        A[m, 32 * s + kk] = E4M3[st[W_OFF + r * 128 + (((byte // 16) ^ (r % 8)) << 4) + byte % 16]]
            # B: the X tile through the descriptor: step s reads bytes 32s.. of each (swizzled) row.
            B = np.zeros((BK, N))
            for s in range(4):
                for nn in range(N):
                    for kk in range(32):
                        byte = 32 * s + kk
                        B[32 * s + kk, nn] = E4M3[st[nn * 128 + (((byte // 16) ^ (nn % 8)) << 4) + byte % 16]]
            D = A @ B  # [64][N]
            for w4 in range(4):
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    for i in range(N // 8):
                        for e in range(4):
                            acc[4 * wg + w4, lane, 4 * i + e] = D[16 * w4 + g + 8 * (e // 2), 8 * i + 2 * t + e % 2]
        scales = st.view(np.float32)
        w_lo, w_hi = scales[WS_OFF // 4], scales[WS_OFF // 4 + (1 if E == SWIGLU else 0)]
        for warp in range(8):
            for lane in range(32):
                t = lane % 4
                for i in range(N // 8):
                    xs0, xs1 = scales[XS_OFF // 4 + 8 * i + 2 * t], scales[XS_OFF // 4 + 8 * i + 2 * t + 1]
                    d[warp, lane, 4 * i + 0] += acc[warp, lane, 4 * i + 0] * (w_lo * xs0)
                    d[warp, lane, 4 * i + 1] += acc[warp, lane, 4 * i + 1] * (w_lo * xs1)
                    d[warp, lane, 4 * i + 2] += acc[warp, lane, 4 * i + 2] * (w_hi * xs0)
                    d[warp, lane, 4 * i + 3] += acc[warp, lane, 4 * i + 3] * (w_hi * xs1)
    # Epilogue.
    for warp in range(8):
        for lane in range(32):
            g, t = lane // 4, lane % 4
            r_lo = 16 * warp + g
            for i in range(N // 8):
                for e2 in range(2):
                    tok = 8 * i + 2 * t + e2
                    if tok >= rows:
                        continue
                    if E == STORE:
                        for h in range(2):
                            col = col_tile * BN + r_lo + 8 * h
                            if col < n:
                                y[c_row_s[tok], col] = d[warp, lane, 4 * i + 2 * h + e2]
                    else:
                        half, j = n // 2, col_tile * (BN // 2) + 8 * warp + g
                        if j < half:
                            y[c_row_s[tok], j] = silu(d[warp, lane, 4 * i + e2]) * d[warp, lane, 4 * i + 2 + e2]


def reference(wq, ws, xq, xs, mat, rows_x, n, k):
    """y[t][r] = Σ_kb ws[r/128][kb] · xs[t][kb] · Σ w·x, for X rows rows_x of matrix mat."""
    kb = k // BK
    w = E4M3[wq[mat]]  # [n][k]
    x = E4M3[xq[rows_x]]  # [t][k]
    y = np.zeros((len(rows_x), n))
    for b in range(kb):
        part = x[:, b * BK:(b + 1) * BK] @ w[:, b * BK:(b + 1) * BK].T
        wsb = np.repeat(ws[mat][:, b], QBLOCK)[:n]
        y += part * xs[rows_x][:, b:b + 1] * wsb[None, :]
    return y


def random_case(rng, count, n, k, x_rows):
    wq = rng.integers(0, 0x71, size=(count, n, k), dtype=np.uint8) | (rng.integers(0, 2, size=(count, n, k), dtype=np.uint8) << 7)
    ws = rng.uniform(1e-3, 4e-3, size=(count, (n + QBLOCK - 1) // QBLOCK, k // BK))
    xq = rng.integers(0, 0x71, size=(x_rows, k), dtype=np.uint8) | (rng.integers(0, 2, size=(x_rows, k), dtype=np.uint8) << 7)
    xs = rng.uniform(0.5, 2.0, size=(x_rows, k // BK))
    return wq, ws.astype(np.float32), xq, xs.astype(np.float32)


def check(what, got, want):
    err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)
    print(f"{what}: max error {err:.2e} of the largest output")
    assert err < 1e-5, what


def main():
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed {seed} (pass it as the argument to repeat)")
    rng = np.random.default_rng(seed)
    # Dense: 100 tokens (N = 128) and 40 (N = 64), a partial column tile, two k-tiles.
    for t, n, swiglu in [(100, 192, False), (40, 256, True)]:
        k = 256
        wq, ws, xq, xs = random_case(rng, 1, n, k, t)
        E = SWIGLU if swiglu else STORE
        width = n // 2 if swiglu else n
        y = np.full((t, width), np.nan)
        L = Launch(wq, ws, xq, xs, n, k, t, t, 1)
        run(E, L, y, (t + BM - 1) // BM, t)
        want = reference(wq, ws, xq, xs, 0, np.arange(t), n, k)
        if swiglu:
            want = silu(want[:, :n // 2]) * want[:, n // 2:]
        assert not np.isnan(y).any(), "an output was never written"
        check(f"dense {t}×{n}{' SwiGLU' if swiglu else ''}", y, want)
    # Grouped: 3 experts, tokens × top-2 pairs gathered (gate‖up) and scattered (down).
    tokens, top_k, experts, k, n = 30, 2, 3, 128, 256
    ids = np.array([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).reshape(-1)
    sorted_pairs = np.concatenate([np.nonzero(ids == e)[0] for e in range(experts)])
    tiles, first = [], 0
    for e in range(experts):
        cnt = int(np.sum(ids == e))
        for i in range(0, cnt, BM):
            tiles.append((e, first + i, min(BM, cnt - i)))
        first += cnt
    wq, ws, xq, xs = random_case(rng, experts, n, k, tokens)
    pairs = tokens * top_k
    act = np.full((pairs, n // 2), np.nan)
    L = Launch(wq, ws, xq, xs, n, k, tokens, pairs, experts, tiles=tiles, a_rows=sorted_pairs, a_div=top_k)
    run(SWIGLU, L, act, len(tiles), pairs)
    want = np.zeros_like(act)
    for p, pair in enumerate(sorted_pairs):
        g = reference(wq, ws, xq, xs, ids[pair], np.array([pair // top_k]), n, k)[0]
        want[p] = silu(g[:n // 2]) * g[n // 2:]
    assert not np.isnan(act).any()
    check("grouped gate‖up (gathered)", act, want)
    wq2, ws2, aq, as_ = random_case(rng, experts, 128, n // 2, pairs)
    routed = np.full((pairs, 128), np.nan)
    L = Launch(wq2, ws2, aq, as_, 128, n // 2, pairs, pairs, experts, tiles=tiles, c_rows=sorted_pairs)
    run(STORE, L, routed, len(tiles), pairs)
    want = np.zeros_like(routed)
    for p, pair in enumerate(sorted_pairs):
        want[pair] = reference(wq2, ws2, aq, as_, ids[pair], np.array([p]), 128, n // 2)[0]
    assert not np.isnan(routed).any()
    check("grouped down (scattered)", routed, want)
    print("emulated gemm_fp8.cu matches numpy")


if __name__ == "__main__":
    main()
