#!/usr/bin/env python3
"""The numerics of a W4A16 GEMV that takes the scale and the zero point out of its inner loop (bench/RESULTS.md,
2026-11-27 seventh session), against the numerics the GPU has now, both measured against the exact dequantized
product; plain Python (float32 and bfloat16 emulated with struct), no dependencies.

    now:     y = sum_k x_k * bf16((u_k - z) * s_g)          fp32 sums (the weights rounded once, as transformers does)
    folded:  y = sum_g s_g * (sum_{k in g} (128 + u_k) x_k - (128 + z) sum_{k in g} x_k)
             fp32 sums; (128 + u) x is exact in fp32 (bf16 products), so only the sums and the one scale round.

Prints the worst |y - exact| / S over random rows, S = sum_k |(u_k - z) s_g x_k| (the tests' error scale).

    python3 tools/gemv_fold_numerics.py [ROWS]        (ROWS: 48 by default; K 4096, group 128, z 8)
"""
import random
import struct
import sys


def f32(a):
    return struct.unpack("f", struct.pack("f", a))[0]


def bf16(a):  # round to nearest even, as __float2bfloat16
    b = struct.unpack("I", struct.pack("f", a))[0]
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return struct.unpack("f", struct.pack("I", b & 0xFFFFFFFF))[0]


def main():
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 48
    k_total, group, zero = 4096, 128, 8
    rng = random.Random(1)
    worst_now = worst_folded = 0.0
    for _ in range(rows):
        x = [bf16(rng.gauss(0, 1)) for _ in range(k_total)]
        u = [rng.randrange(16) for _ in range(k_total)]
        s = [bf16(rng.random() * 0.02 + 0.001) for _ in range(k_total // group)]
        exact = sum((u[k] - zero) * s[k // group] * x[k] for k in range(k_total))
        scale = sum(abs((u[k] - zero) * s[k // group] * x[k]) for k in range(k_total))
        now = 0.0
        for k in range(k_total):
            now = f32(now + f32(bf16((u[k] - zero) * s[k // group]) * x[k]))
        folded = 0.0
        for g in range(k_total // group):
            partial = sum_x = 0.0
            for k in range(g * group, (g + 1) * group):
                partial = f32(partial + f32((128 + u[k]) * x[k]))
                sum_x = f32(sum_x + x[k])
            folded = f32(folded + f32(s[g] * f32(partial - f32((128 + zero) * sum_x))))
        worst_now = max(worst_now, abs(now - exact) / scale)
        worst_folded = max(worst_folded, abs(folded - exact) / scale)
    print(f"{rows} rows, K {k_total}, group {group}, zero point {zero}")
    print(f"now (bf16 weights, fp32 sums):         max |y - exact| / S = {worst_now:.2e}")
    print(f"folded (scale and zero once a group):  max |y - exact| / S = {worst_folded:.2e}")


if __name__ == "__main__":
    main()
