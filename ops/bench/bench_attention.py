"""Forest attention at the 27B attention-layer shape: the 16-row kernel vs the large-block one and
the ancestor split (CUDA).

    PYTHONPATH=. python3 ops/bench/bench_attention.py [--reps 20] [--out attn.json] [--no-sweep]
        [--split-sweep] [--workload q8k ...]

One attention layer (24 query heads, 4 KV heads, head_dim 256), random normalised q / k / v in
fp32 K/V blocks laid out as `engine.run.body` lays them (one own block per segment, the evidence's
block read in place as the questions' ancestor piece, tables padded to the body's buckets):

  (a) one 256-token segment
  (b) a 256-token evidence segment + 3 question segments of 40 tokens (children of it)
  (c) one 8,192-token segment
  (q8k) one 36-token question after a cached 27-token system segment and a cached 8,156-token
        evidence segment (both read in place, not in the pass): the question's own cost, bucket 64
  (cq) request (c) as the body runs it: the 8,156-token evidence and its 36-token question in one
        8,192-token pass after the cached system segment

For each kernel setting: ms per layer (CUDA events around each launch after warm-up, median of
--reps), the same x 16 layers, effective TFLOP/s (4 * head_dim flops per (query head, query,
visible key): the causal work, not the padded tiles) and the largest |difference| from the
exact "ieee" 16-row kernel on the same inputs. Settings: "old" is the 16-row kernel for every
segment (`long=False`, `split=False`), "long" the shipped large-block config (`long_config`)
without the ancestor split (the default until the split is measured), "new" the shipped large-block
config and the shipped split (`split_config`); --sweep (default on) adds the other large-block
configs (SWEEP) and --split-sweep the other split configs (SPLIT_SWEEP), so one GPU run picks;
--split-only keeps just the rows the split changes (and the ieee reference). A
config's name reads "BM<query rows> BL<own keys per tile> w<warps> s<stages> kv16|kv32
a<ancestor keys per tile>": kv16 loads the bf16 shadow of the own K/V (its build is timed as
part of the call), kv32 rounds the fp32 tiles in registers (the run-2 kernel); a split's name
"S<splits> L<keys per tile> s<stages> c<capacity>". A summary table (shipped "long" vs "new" per
workload) ends the output.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from engine.kernels.forest_attention import (
    LongConfig,
    SplitConfig,
    forest_attention,
    long_config,
    split_config,
)
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
# the split configs besides the shipped one (sm_90 resources: ops/bench/NOTES-kernels.md)
SPLIT_SWEEP = [
    SplitConfig(splits=8, min_keys=1024, capacity=16, block_l=16, num_warps=8, num_stages=2),
    SplitConfig(splits=16, min_keys=1024, capacity=16, block_l=16, num_warps=8, num_stages=2),
    SplitConfig(splits=11, min_keys=1024, capacity=16, block_l=32, num_warps=8, num_stages=2),
    SplitConfig(splits=11, min_keys=1024, capacity=0, block_l=16, num_warps=8, num_stages=2),
]
SYSTEM = 27  # tokens of the cached system segment, the root of every request
# segments (length, parent index, in the pass): a segment not in the pass is cached, read in place
WORKLOADS: dict[str, list[tuple[int, int, bool]]] = {
    "a": [(256, -1, True)],
    "b": [(256, -1, True), (40, 0, True), (40, 0, True), (40, 0, True)],
    "c": [(8192, -1, True)],
    "q8k": [(SYSTEM, -1, False), (8156, 0, False), (36, 1, True)],
    "cq": [(SYSTEM, -1, False), (8156, 0, True), (36, 1, True)],
}
# (token bucket, segment slots)
BUCKETS = {"a": (256, 4), "b": (384, 4), "c": (8192, 4), "q8k": (64, 4), "cq": (8192, 4)}


def build(workload: str, gen: torch.Generator) -> dict:
    """Tables and data of one workload: segments (length, parent index, in the pass); those in the
    pass are packed in order, each reads its ancestors' blocks (oldest first) and its own."""
    segments = WORKLOADS[workload]
    t_bucket, s_bucket = BUCKETS[workload]
    base_len = sum(2 * NKV * n * HD for n, _, _ in segments) + 64
    base = torch.randn(base_len, generator=gen, device="cuda")
    rows = torch.zeros(t_bucket, ROW_FIELDS, dtype=torch.int64)
    segs = torch.zeros(s_bucket, SEG_FIELDS, dtype=torch.int64)
    pieces = torch.zeros(s_bucket, PIECES, 4, dtype=torch.int64)
    qblocks = torch.zeros(t_bucket // BLOCK_M + s_bucket, QBLOCK_FIELDS, dtype=torch.int64)
    own: list[list[int]] = []
    chains: list[list[int]] = []  # per segment: its ancestors, oldest first
    off, row, nq, slot, total, flops = 0, 0, 0, 0, 0, 0
    for s, (n, parent, in_pass) in enumerate(segments):
        own.append([off, off + NKV * n * HD, n, n])
        off += 2 * NKV * n * HD
        chains.append([*chains[parent], parent] if parent >= 0 else [])
        if not in_pass:
            continue
        segs[slot, 0], segs[slot, 1], segs[slot, 7] = row, n, 1
        rows[row : row + n, 0] = slot
        rows[row : row + n, 1] = torch.arange(n)
        rows[row : row + n, 2] = 1
        for i, a in enumerate(chains[s]):
            pieces[slot, i] = torch.tensor(own[a])
        pieces[slot, PIECES - 1] = torch.tensor(own[s])
        for b in range(0, n, BLOCK_M):
            qblocks[nq] = torch.tensor([slot, b, 1])
            nq += 1
        before = sum(segments[a][0] for a in chains[s])
        flops += 4 * HD * NH * (n * before + n * (n + 1) // 2)
        row += n
        total += n
        slot += 1
    # q, k as after RMSNorm (unit RMS per head vector), v unit-variance
    q = torch.randn(t_bucket, NH, HD, generator=gen, device="cuda")
    qg = torch.randn(t_bucket, NH * 2 * HD, generator=gen, device="cuda")
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
    ap.add_argument("--no-sweep", action="store_true", help="no other large-block configs")
    ap.add_argument("--split-sweep", action="store_true", help="the other split configs too")
    ap.add_argument(
        "--split-only",
        action="store_true",
        help="only old ieee (the reference), long bf16 (shipped), new bf16 and --split-sweep's",
    )
    ap.add_argument("--workload", action="append", choices=sorted(WORKLOADS), help="repeatable; default all")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_attention needs CUDA", file=sys.stderr)
        return 2
    shipped = long_config(HD)
    split = split_config(HD)
    assert split is not None
    # (name, dots, long, split)
    settings: list[tuple[str, str, LongConfig | bool, SplitConfig | bool]] = [
        ("old ieee", "ieee", False, False),
        ("old bf16", "bf16", False, False),
        ("old tf32", "tf32", False, False),
        (f"long bf16 {_name(shipped)}", "bf16", True, False),
        (f"new bf16 {_name(shipped)} {_split_name(split)}", "bf16", True, True),
        (f"new tf32 {_name(long_config(HD, 'tf32'), 'tf32')}", "tf32", True, False),
    ]
    if args.split_only:
        settings = [
            row for row in settings if row[0] == "old ieee" or row[0].startswith(("long bf16", "new bf16"))
        ]
    if not args.no_sweep and not args.split_only:
        for cfg in SWEEP:
            if cfg != shipped:
                settings.append((f"new bf16 {_name(cfg)}", "bf16", cfg, True))
    if args.split_sweep:
        for scfg in SPLIT_SWEEP:
            if scfg != split:
                settings.append((f"new bf16 {_name(shipped)} {_split_name(scfg)}", "bf16", True, scfg))
    t0 = time.perf_counter()
    out_rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    head = ("workload", "setting", "ms/layer", "x16 ms", "TFLOP/s", "max|d| vs ieee")
    print("{:<8} {:<52} {:>9} {:>8} {:>8} {:>15}".format(*head))
    for w in args.workload or sorted(WORKLOADS):
        d = build(w, gen)
        exact = None
        for name, dots, long, split_cfg in settings:

            def run(
                dots: str = dots,
                long: LongConfig | bool = long,
                split_cfg: SplitConfig | bool = split_cfg,
                d: dict = d,
            ) -> torch.Tensor:
                return forest_attention(
                    d["q"], d["qg"], d["base"], d["rows"], d["segs"], d["pieces"], d["qblocks"],
                    num_kv_heads=NKV, dots=dots, long=long, split=split_cfg,
                )  # fmt: skip

            try:
                out = run()
                torch.cuda.synchronize()
                slow = dots == "ieee" and w in ("c", "cq")
                reps = max(3, args.reps // 4) if slow else args.reps
                ms = time_ms(run, reps)
            except Exception as e:  # report the failing setting, keep the others
                print(f"{w:<8} {name:<52} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            if exact is None:
                exact = out
            diff = float((out - exact).abs().max())
            tflops = d["flops"] / (ms * 1e-3) / 1e12
            line = f"{w:<8} {name:<52} {ms:>9.3f} {ms * LAYERS:>8.1f} {tflops:>8.1f} {diff:>15.3e}"
            print(line, flush=True)
            out_rows.append(
                dict(workload=w, setting=name, ms_per_layer=ms, ms_16_layers=ms * LAYERS, tflops=tflops,
                     max_abs_diff_vs_ieee=diff, tokens=d["tokens"])
            )  # fmt: skip
    _summary(out_rows)
    print(f"bench_attention: {time.perf_counter() - t0:.0f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out_rows, f, indent=1)
    return 0


def _summary(out_rows: list[dict]) -> None:
    """Per workload: the shipped "long" setting (no split) against "new" (with the split)."""
    print("\nsummary (ms per layer): workload, long (shipped), new (+ split), speedup, new max|d| vs ieee")
    for w in dict.fromkeys(r["workload"] for r in out_rows):
        got: dict[str, dict] = {}  # the first row of each kind: the shipped configs
        for r in out_rows:
            kind, dots = r["setting"].split()[:2]
            if r["workload"] == w and dots == "bf16":
                got.setdefault(kind, r)
        if "long" in got and "new" in got:
            old, new = got["long"]["ms_per_layer"], got["new"]["ms_per_layer"]
            diff = got["new"]["max_abs_diff_vs_ieee"]
            print(f"  {w:<6} {old:>9.3f} {new:>9.3f} {old / new:>7.2f}x {diff:>10.2e}")


def _split_name(cfg: SplitConfig) -> str:
    """e.g. "S11 L16 s2 c32": splits, keys per ancestor tile, stages, capacity."""
    return f"S{cfg.splits} L{cfg.block_l} s{cfg.num_stages} c{cfg.capacity}"


def _name(cfg: LongConfig, dots: str = "bf16") -> str:
    """e.g. "BM64 BL64 w8 s2 kv16 a32": kv16 reads the bf16 shadow (kv32: rounds fp32 tiles in
    registers), aN: ancestor tiles of N keys."""
    kv = "kv16" if cfg.bf16_kv and dots == "bf16" else "kv32"
    return f"BM{cfg.block_m} BL{cfg.block_l} w{cfg.num_warps} s{cfg.num_stages} {kv} a{cfg.ancestor_l}"


if __name__ == "__main__":
    sys.exit(main())
