"""Forest attention at the 27B attention-layer shape: the 16-row kernel vs the large-block one (CUDA).

    PYTHONPATH=. python3 ops/bench/bench_attention.py [--reps 20] [--out attn.json] [--no-sweep]

One attention layer (24 query heads, 4 KV heads, head_dim 256), random normalised q / k / v in
fp32 K/V blocks laid out as `engine.run.body` lays them (one own block per segment, the evidence's
block read in place as the questions' ancestor piece, tables padded to the body's buckets):

  (a) one 256-token segment
  (b) a 256-token evidence segment + 3 question segments of 40 tokens (children of it)
  (c) one 8,192-token segment

For each kernel setting: ms per layer (CUDA events around each launch after warm-up, median of
--reps), the same x 16 layers, effective TFLOP/s (4 * head_dim flops per (query head, query,
visible key): the causal work, not the padded tiles) and the largest |difference| from the
exact "ieee" 16-row kernel on the same inputs. Settings: "old" is the 16-row kernel for every
segment (`long=False`), "new" the shipped large-block config (`long_config`), and --sweep
(default on) adds the other large-block configs (SWEEP), so one GPU run picks the config. A
config's name reads "BM<query rows> BL<own keys per tile> w<warps> s<stages> kv16|kv32
a<ancestor keys per tile>": kv16 loads the bf16 shadow of the own K/V (its build is timed as
part of the call), kv32 rounds the fp32 tiles in registers (the run-2 kernel).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from engine.kernels.forest_attention import LongConfig, forest_attention, long_config
from engine.kernels.forest_tables import BLOCK_M, QBLOCK_FIELDS, ROW_FIELDS, SEG_FIELDS

NH, NKV, HD = 24, 4, 256
LAYERS = 16  # attention layers of the 27B model
PIECES = 4  # the body's smallest piece bucket
# bf16 configs besides the shipped one: sm_90 resources in ops/bench/NOTES-kernels.md (Session 5b)
SWEEP = [
    LongConfig(64, 64, 8, 128, num_stages=1, bf16_kv=False),  # the fp32-tile kernel, best at run 2
    LongConfig(64, 64, 8, 128, num_stages=1, ancestor_block_l=32),
    LongConfig(64, 64, 8, 128, num_stages=3, ancestor_block_l=32),
    LongConfig(64, 64, 8, 128, num_stages=2, ancestor_block_l=16),
    LongConfig(128, 32, 8, 128, num_stages=2, ancestor_block_l=32),
]
WORKLOADS = {"a": [(256, -1)], "b": [(256, -1), (40, 0), (40, 0), (40, 0)], "c": [(8192, -1)]}
BUCKETS = {"a": (256, 4), "b": (384, 4), "c": (8192, 4)}  # (token bucket, segment slots)


def build(workload: str, gen: torch.Generator) -> dict:
    """Tables and data of one workload: segments (length, parent index) packed in order."""
    segments = WORKLOADS[workload]
    t_bucket, s_bucket = BUCKETS[workload]
    total = sum(n for n, _ in segments)
    base_len = sum(2 * NKV * n * HD for n, _ in segments) + 64
    base = torch.randn(base_len, generator=gen, device="cuda")
    rows = torch.zeros(t_bucket, ROW_FIELDS, dtype=torch.int64)
    segs = torch.zeros(s_bucket, SEG_FIELDS, dtype=torch.int64)
    pieces = torch.zeros(s_bucket, PIECES, 4, dtype=torch.int64)
    qblocks = torch.zeros(t_bucket // BLOCK_M + s_bucket, QBLOCK_FIELDS, dtype=torch.int64)
    own: list[list[int]] = []
    off, row, nq = 0, 0, 0
    for s, (n, parent) in enumerate(segments):
        own.append([off, off + NKV * n * HD, n, n])
        off += 2 * NKV * n * HD
        segs[s, 0], segs[s, 1], segs[s, 7] = row, n, 1
        rows[row : row + n, 0] = s
        rows[row : row + n, 1] = torch.arange(n)
        rows[row : row + n, 2] = 1
        if parent >= 0:
            pieces[s, 0] = torch.tensor(own[parent])
        pieces[s, PIECES - 1] = torch.tensor(own[s])
        for b in range(0, n, BLOCK_M):
            qblocks[nq] = torch.tensor([s, b, 1])
            nq += 1
        row += n
    # q, k as after RMSNorm (unit RMS per head vector), v unit-variance
    q = torch.randn(t_bucket, NH, HD, generator=gen, device="cuda")
    qg = torch.randn(t_bucket, NH * 2 * HD, generator=gen, device="cuda")
    flops = 0
    for n, parent in segments:
        before = segments[parent][0] if parent >= 0 else 0
        flops += 4 * HD * NH * (n * before + n * (n + 1) // 2)
    return dict(
        q=q, qg=qg, base=base, rows=rows.cuda(), segs=segs.cuda(), pieces=pieces.cuda(),
        qblocks=qblocks.cuda(), tokens=total, flops=flops,
    )  # fmt: skip


def time_ms(fn, reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--no-sweep", action="store_true", help="only old and new at the shipped config")
    ap.add_argument("--workload", action="append", choices=sorted(WORKLOADS), help="repeatable; default all")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_attention needs CUDA", file=sys.stderr)
        return 2
    shipped = long_config(HD)
    settings: list[tuple[str, str, LongConfig | bool]] = [
        ("old ieee", "ieee", False),
        ("old bf16", "bf16", False),
        ("old tf32", "tf32", False),
        (f"new bf16 {_name(shipped)}", "bf16", True),
        (f"new tf32 {_name(long_config(HD, 'tf32'), 'tf32')}", "tf32", True),
    ]
    if not args.no_sweep:
        for cfg in SWEEP:
            if cfg != shipped:
                settings.append((f"new bf16 {_name(cfg)}", "bf16", cfg))
    t0 = time.perf_counter()
    out_rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    head = ("workload", "setting", "ms/layer", "x16 ms", "TFLOP/s", "max|d| vs ieee")
    print("{:<8} {:<32} {:>9} {:>8} {:>8} {:>15}".format(*head))
    for w in args.workload or sorted(WORKLOADS):
        d = build(w, gen)
        exact = None
        for name, dots, long in settings:

            def run(dots: str = dots, long: LongConfig | bool = long, d: dict = d) -> torch.Tensor:
                return forest_attention(
                    d["q"], d["qg"], d["base"], d["rows"], d["segs"], d["pieces"], d["qblocks"],
                    num_kv_heads=NKV, dots=dots, long=long,
                )  # fmt: skip

            try:
                out = run()
                torch.cuda.synchronize()
                reps = max(3, args.reps // 4) if (dots == "ieee" and w == "c") else args.reps
                ms = time_ms(run, reps)
            except Exception as e:  # report the failing setting, keep the others
                print(f"{w:<8} {name:<32} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            if exact is None:
                exact = out
            diff = float((out - exact).abs().max())
            tflops = d["flops"] / (ms * 1e-3) / 1e12
            line = f"{w:<8} {name:<32} {ms:>9.3f} {ms * LAYERS:>8.1f} {tflops:>8.1f} {diff:>15.3e}"
            print(line, flush=True)
            out_rows.append(
                dict(workload=w, setting=name, ms_per_layer=ms, ms_16_layers=ms * LAYERS, tflops=tflops,
                     max_abs_diff_vs_ieee=diff, tokens=d["tokens"])
            )  # fmt: skip
    print(f"bench_attention: {time.perf_counter() - t0:.0f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out_rows, f, indent=1)
    return 0


def _name(cfg: LongConfig, dots: str = "bf16") -> str:
    """e.g. "BM64 BL64 w8 s2 kv16 a32": kv16 reads the bf16 shadow (kv32: rounds fp32 tiles in
    registers), aN: ancestor tiles of N keys."""
    kv = "kv16" if cfg.bf16_kv and dots == "bf16" else "kv32"
    return f"BM{cfg.block_m} BL{cfg.block_l} w{cfg.num_warps} s{cfg.num_stages} {kv} a{cfg.ancestor_l}"


if __name__ == "__main__":
    sys.exit(main())
