"""Forest attention at the 27B (and 4B) attention-layer shapes, the way the body runs it: every
setting captured in a CUDA graph, old configs against new ones in one process (CUDA).

    source ops/device/setup.sh
    PYTHONPATH=. python3 ops/bench/bench_attention.py [--reps 20] [--out $OUT/attn.json]
        [--workload a --workload c ...] [--heads 27B --heads 4B] [--no-kernels] [--quick]

One attention layer (27B: 24 query heads over 4 KV heads of 256; 4B: 16 over 4), random q / k / v
in fp32 K/V blocks laid out as `engine.run.body` lays them (one own block per segment, a cached
segment's block read in place as an ancestor piece, tables padded to the body's buckets), the
forests of `ops/bench/bench_engine.py`'s workloads after its 27-token cached system segment:

  a    one request: 220 evidence tokens + a 36-token question (bucket 256)
  b    220 evidence tokens + 3 questions of 36 (bucket 384)
  c    8,156 evidence tokens + a 36-token question (bucket 8,192)
  q8k  the 36-token question alone after a cached 8,156-token evidence (bucket 64)

Why graphs: the engine replays the whole pass as one CUDA graph, and a 20-100 us launch timed
eagerly is mostly Python launch latency (session 8 read the split's two extra launches as a 1.6x
slowdown of (a)/(b) that way). Each setting's call is captured GRAPH_CALLS times into one graph;
a replay's time / GRAPH_CALLS is the layer's time ("us/layer", median of --reps replays).
"kernels" splits one call into its launches' GPU time (torch.profiler over eager calls: the
kernels' own durations, no launch gaps): 16-row kernel, large-block kernel(s), split, plan, shadow,
the CUTLASS FMHA kernel ("fmha").

Every setting is compared with the first ("s10": the session-10 engine: the single large-block
config, no split, fp32 K/V copied 4 bytes at a time) on the same inputs: "bits" is "=" when the
whole output is bitwise equal, else the share of rows that are (a setting that moves no bit -
"a4", q16 - must read "="; one that changes a reduction order - a tier's block size, the split -
changes the rows it takes), and max|d| is the largest difference. Settings (`settings()`): "a4"
has the 16-byte K/V loads (`PIECE_ALIGN` 4; every later setting has them too), the shipped split
and short-ancestor split rules (`SplitConfig.min_tiles`), the length tiers (`long_configs(form=
"tiered")`), and large-block candidates for 8k (q16, tiles). Prints one table and a summary per
workload (best setting vs s10); --out writes every row as JSON. About 2-3 minutes on one H200
(most of it compiling ~50 builds); --quick keeps the split and tier settings, --heads 27B halves it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

import engine.kernels.forest_attention as fa
from engine.kernels.forest_attention import (
    LongConfig,
    SplitConfig,
    forest_attention,
    long_config,
    long_configs,
    split_config,
)
from engine.kernels.forest_tables import BLOCK_M, QBLOCK_FIELDS, ROW_FIELDS, SEG_FIELDS

HEADS = {"27B": (24, 4, 256), "4B": (16, 4, 256)}  # query heads, KV heads, head_dim
LAYERS = {"27B": 16, "4B": 8}  # attention layers (full_attention_interval 4)
PIECES = 4  # the body's smallest piece bucket
DEVICE = "cuda"
GRAPH_CALLS = 10  # calls captured in one graph (a replay's launch cost spread over them)
SYSTEM = 27  # tokens of the cached system segment, the root of every request
# segments (length, parent index, in the pass): a segment not in the pass is cached, read in place
WORKLOADS: dict[str, list[tuple[int, int, bool]]] = {
    "a": [(SYSTEM, -1, False), (220, 0, True), (36, 1, True)],
    "b": [(SYSTEM, -1, False), (220, 0, True), (36, 1, True), (36, 1, True), (36, 1, True)],
    "c": [(SYSTEM, -1, False), (8156, 0, True), (36, 1, True)],
    "q8k": [(SYSTEM, -1, False), (8156, 0, False), (36, 1, True)],
}
BUCKETS = {"a": (256, 4), "b": (384, 8), "c": (8192, 4), "q8k": (64, 4)}  # (tokens, segment slots)

HD = 256
S10 = long_configs(HD, "bf16", "s10")
TIERED = long_configs(HD, "bf16", "tiered")
SPLIT_SHIPPED = split_config(HD)
assert SPLIT_SHIPPED is not None
# short-ancestor split rules: (a)/(b)'s questions see 247 ancestor keys (16 tiles of 16)
SPLIT_SHORT = {
    "S11 L16 t4 k128": SplitConfig(splits=11, min_keys=128, capacity=16, block_l=16, num_warps=8,
                                   num_stages=2, min_tiles=4),
    "S4 L32 t2 k128": SplitConfig(splits=4, min_keys=128, capacity=16, block_l=32, num_warps=8,
                                  num_stages=2, min_tiles=2),
    "S11 L16 t2 k128": SplitConfig(splits=11, min_keys=128, capacity=16, block_l=16, num_warps=8,
                                   num_stages=2, min_tiles=2),
}  # fmt: skip
SPLIT_LONG = {  # the 8k question: other split counts and tiles than the shipped S11 L16
    "S16 L16 k1024": SplitConfig(
        splits=16, min_keys=1024, capacity=16, block_l=16, num_warps=8, num_stages=2
    ),
    "S11 L32 k1024": SplitConfig(
        splits=11, min_keys=1024, capacity=16, block_l=32, num_warps=8, num_stages=2
    ),
}
# large-block candidates for the 8k evidence (one config for every long segment)
LONG_8K = {
    "BM128 BL32 a32 q16": LongConfig(128, 32, 8, 128, num_stages=2, ancestor_block_l=32, q16=True),
    "BM128 BL32 a16": LongConfig(128, 32, 8, 128, num_stages=2, ancestor_block_l=16),
    "BM128 BL64 a16 q16": LongConfig(128, 64, 8, 128, num_stages=2, ancestor_block_l=16, q16=True),
    "BM128 BL32 s3 a16 q16": LongConfig(128, 32, 8, 128, num_stages=3, ancestor_block_l=16, q16=True),
    "BM64 BL64 a32": LongConfig(64, 64, 8, 128, num_stages=2, ancestor_block_l=32),
}
# tier boundaries other than TIER_LENGTH's 1,024 (the short tier's config, the long one's)
TIER_SHORT_ALT = {
    "tiered BM64 BL32 w4": (LongConfig(64, 32, 4, 128, num_stages=2, ancestor_block_l=16, max_length=1024),),
}

Setting = tuple[str, str, "LongConfig | tuple[LongConfig, ...] | bool", "SplitConfig | bool", int]


def settings(quick: bool) -> list[Setting]:
    """(name, dots, long, split, PIECE_ALIGN), the baseline first: "s10" is the session-10 build
    (no alignment hint); every other setting has the 16-byte K/V loads (PIECE_ALIGN 4)."""
    big = long_config(HD)
    rows: list[Setting] = [
        ("s10", "bf16", S10, False, 1),
        ("s10 a4", "bf16", S10, False, 4),
        ("s10 a4 + split shipped", "bf16", S10, SPLIT_SHIPPED, 4),
        ("tiered", "bf16", TIERED, False, 4),
    ]
    for name, cfg in SPLIT_SHORT.items():
        rows.append((f"s10 a4 + split {name}", "bf16", S10, cfg, 4))
        rows.append((f"tiered + split {name}", "bf16", TIERED, cfg, 4))
    if quick:
        return rows
    rows.append(("s10 + split shipped (no hint)", "bf16", S10, SPLIT_SHIPPED, 1))
    for name, cfg in SPLIT_LONG.items():
        rows.append((f"s10 a4 + split {name}", "bf16", S10, cfg, 4))
    for name, cfg in LONG_8K.items():
        rows.append((f"long {name}", "bf16", cfg, False, 4))
    for name, (short,) in TIER_SHORT_ALT.items():
        rows.append((name, "bf16", (short, LongConfig(**{**big.__dict__, "min_length": 1024})), False, 4))
    rows += [
        ("16-row only bf16", "bf16", False, False, 4),
        ("16-row only ieee (no hint)", "ieee", False, False, 1),
        ("16-row only ieee", "ieee", False, False, 4),
    ]
    return rows


def build(workload: str, heads: tuple[int, int, int], gen: torch.Generator) -> dict:
    """Tables and data of one workload: segments (length, parent index, in the pass); those in the
    pass are packed in order, each reads its ancestors' blocks (oldest first) and its own."""
    nh, nkv, hd = heads
    segments = WORKLOADS[workload]
    t_bucket, s_bucket = BUCKETS[workload]
    base_len = sum(2 * nkv * n * hd for n, _, _ in segments) + 64
    base = torch.randn(base_len, generator=gen, device=DEVICE)
    rows = torch.zeros(t_bucket, ROW_FIELDS, dtype=torch.int64)
    segs = torch.zeros(s_bucket, SEG_FIELDS, dtype=torch.int64)
    pieces = torch.zeros(s_bucket, PIECES, 4, dtype=torch.int64)
    qblocks = torch.zeros(t_bucket // BLOCK_M + s_bucket, QBLOCK_FIELDS, dtype=torch.int64)
    own: list[list[int]] = []
    chains: list[list[int]] = []  # per segment: its ancestors, oldest first
    off, row, nq, slot, flops = 0, 0, 0, 0, 0
    live = torch.zeros(t_bucket, dtype=torch.bool)
    for s, (n, parent, in_pass) in enumerate(segments):
        own.append([off, off + nkv * n * hd, n, n])
        off += 2 * nkv * n * hd
        chains.append([*chains[parent], parent] if parent >= 0 else [])
        if not in_pass:
            continue
        segs[slot, 0], segs[slot, 1], segs[slot, 7] = row, n, 1
        rows[row : row + n, 0] = slot
        rows[row : row + n, 1] = torch.arange(n)
        rows[row : row + n, 2] = 1
        live[row : row + n] = True
        for i, a in enumerate(chains[s]):
            pieces[slot, i] = torch.tensor(own[a])
        pieces[slot, PIECES - 1] = torch.tensor(own[s])
        for b in range(0, n, BLOCK_M):
            qblocks[nq] = torch.tensor([slot, b, 1])
            nq += 1
        before = sum(segments[a][0] for a in chains[s])
        flops += 4 * hd * nh * (n * before + n * (n + 1) // 2)
        row += n
        slot += 1
    q = torch.randn(t_bucket, nh, hd, generator=gen, device=DEVICE)  # as after RMSNorm: unit RMS
    qg = torch.randn(t_bucket, nh * 2 * hd, generator=gen, device=DEVICE)
    return dict(
        q=q, qg=qg, base=base, rows=rows.to(DEVICE), segs=segs.to(DEVICE), pieces=pieces.to(DEVICE),
        qblocks=qblocks.to(DEVICE), live=live.to(DEVICE), flops=flops, nkv=nkv,
    )  # fmt: skip


def graph_us(fn: Callable[[], torch.Tensor], reps: int) -> float:
    """Median GPU time of one call, from replays of a graph holding GRAPH_CALLS calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / GRAPH_CALLS)
    del graph
    return statistics.median(times)


KERNEL_NAMES = {
    "_attention_kernel": "16row",
    "_long_attention_kernel": "long",
    "_split_kernel": "split",
    "_split_plan_kernel": "plan",
    "_shadow_kernel": "shadow",
}


def kernel_us(fn: Callable[[], torch.Tensor], calls: int = 5) -> dict[str, float]:
    """GPU time per call of each attention kernel (eager, torch.profiler): what a graph's time
    is made of, without the launch gaps; the CUTLASS FMHA kernel under "fmha", other kernels (the
    output's memset) under "other"."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    got: dict[str, float] = {}
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None)
        if us is None:
            us = getattr(evt, "self_cuda_time_total", 0.0)
        if not us:
            continue
        key = KERNEL_NAMES.get(evt.key) or ("fmha" if "cutlass" in evt.key else "other")
        got[key] = got.get(key, 0.0) + us / calls
    return got


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None, help="JSON of every row (default $OUT/bench_attention.json)")
    ap.add_argument("--workload", action="append", choices=sorted(WORKLOADS), help="repeatable; default all")
    ap.add_argument("--heads", action="append", choices=sorted(HEADS), help="repeatable; default 27B, 4B")
    ap.add_argument("--no-kernels", action="store_true", help="no per-kernel profile")
    ap.add_argument("--quick", action="store_true", help="the split and tier settings only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_attention needs CUDA", file=sys.stderr)
        return 2
    out_path = args.out or (
        os.path.join(os.environ["OUT"], "bench_attention.json") if "OUT" in os.environ else None
    )
    t0 = time.perf_counter()
    rows: list[dict] = []
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    head = ("heads", "wl", "setting", "us/layer", "x L ms", "TFLOP/s", "bits", "max|d|", "kernels (us)")
    print("{:<4} {:<4} {:<36} {:>9} {:>7} {:>7} {:>6} {:>9}  {}".format(*head), flush=True)
    for shape in args.heads or ["27B", "4B"]:
        for w in args.workload or ["a", "b", "c", "q8k"]:
            d = build(w, HEADS[shape], gen)
            base_out = None
            for name, dots, long, split, align in settings(args.quick):
                if dots == "ieee" and w in ("c", "q8k"):
                    continue  # 100+ ms a layer at 8k: nothing to learn from it here

                def run(
                    dots: str = dots,
                    long: object = long,
                    split: object = split,
                    d: dict = d,
                    align: int = align,
                ) -> torch.Tensor:
                    fa.PIECE_ALIGN = align  # read at each launch (a constexpr: its own build)
                    return forest_attention(
                        d["q"], d["qg"], d["base"], d["rows"], d["segs"], d["pieces"], d["qblocks"],
                        num_kv_heads=d["nkv"], dots=dots, long=long, split=split,  # type: ignore[arg-type]
                    )  # fmt: skip

                try:
                    out = run()
                    torch.cuda.synchronize()
                    us = graph_us(run, args.reps)
                    kern = {} if args.no_kernels else kernel_us(run)
                except Exception as e:  # report the failing setting, keep the others
                    if os.environ.get("BENCH_RAISE"):
                        raise
                    print(
                        f"{shape:<4} {w:<4} {name:<36} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True
                    )
                    continue
                if base_out is None:
                    base_out = out
                live = d["live"]
                same_rows = (out == base_out).all(dim=1)[live]
                bits = "=" if bool(same_rows.all()) else f"{float(same_rows.float().mean()):.2f}"
                diff = float((out - base_out).abs().max())
                tflops = d["flops"] / (us * 1e-6) / 1e12
                ms_layers = us * LAYERS[shape] / 1e3
                ks = " ".join(f"{k} {v:.1f}" for k, v in sorted(kern.items(), key=lambda kv: -kv[1]))
                print(
                    f"{shape:<4} {w:<4} {name:<36} {us:>9.1f} {ms_layers:>7.2f} {tflops:>7.1f} {bits:>6} "
                    f"{diff:>9.2e}  {ks}",
                    flush=True,
                )
                rows.append(dict(heads=shape, workload=w, setting=name, us_per_layer=us,
                                 ms_all_layers=ms_layers, tflops=tflops,
                                 bits_equal_rows=float(same_rows.float().mean()), max_abs_diff_vs_s10=diff,
                                 kernels_us=kern))  # fmt: skip
    _summary(rows)
    print(f"bench_attention: {time.perf_counter() - t0:.0f} s", flush=True)
    if out_path:
        with open(out_path, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _summary(rows: list[dict]) -> None:
    """Per heads and workload: s10 against the fastest bf16 setting, and the time saved per pass."""
    print("\nsummary: heads, workload, s10 us/layer, best setting, its us/layer, saved ms per pass")
    for shape, w in dict.fromkeys((r["heads"], r["workload"]) for r in rows):
        mine = [r for r in rows if r["heads"] == shape and r["workload"] == w and "ieee" not in r["setting"]]
        if not mine:
            continue
        base = mine[0]
        best = min(mine, key=lambda r: r["us_per_layer"])
        saved = (base["us_per_layer"] - best["us_per_layer"]) * LAYERS[shape] / 1e3
        print(f"  {shape:<4} {w:<4} {base['us_per_layer']:>8.1f}  {best['setting']:<36} "
              f"{best['us_per_layer']:>8.1f}  {saved:>6.2f}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
