"""Tensor-parallel engine benchmark: the seed's workloads (a)-(d) on N GPUs, plus a bit check.

Every rank builds the same random int8 model of the given shape (same seed, on its own GPU;
see bench_engine.py), keeps its slice (`engine.run.tp.shard_weights`) and runs the workloads in
lockstep; rank 0 times them. Before that, rank 0 runs a check forest (evidence + 3 questions)
with the whole model alone and compares the tensor-parallel logits with it bit for bit.

    python ops/bench/bench_tp.py --shape 27B --tp 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time

import torch
import torch.distributed as dist
from bench_engine import VOCAB, Bench, random_weights, run_workloads, shape_config, show, sync

from engine.run.body import ForestBody
from engine.run.forest import Segment, build_forest
from engine.run.tp import close_group, free_port, init_group, shard_weights


def check_segments(root_tokens: tuple[int, ...], g: torch.Generator) -> list[Segment]:
    def tokens(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(0, VOCAB - 512, (n,), generator=g).tolist())

    segs = [Segment(root_tokens, None), Segment(tokens(300), 0)]
    return segs + [Segment(tokens(36), 1, read=True) for _ in range(3)]


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")  # cpu: a gloo smoke run
    tp = init_group(rank, world, device, port)
    try:
        config = shape_config(args.shape)
        t0 = time.perf_counter()
        full = random_weights(config, str(device))
        g = torch.Generator().manual_seed(1)
        root_tokens = tuple(torch.randint(0, VOCAB - 512, (27,), generator=g).tolist())
        check = build_forest(check_segments(root_tokens, torch.Generator().manual_seed(2)))
        reference = ForestBody(full).run(check).logits if rank == 0 else None
        weights = shard_weights(full, tp)
        del full
        sync()
        name = torch.cuda.get_device_name(device) if cuda else "cpu"
        result: dict = {"shape": args.shape, "tp": world, "device": name}
        result["build_s"] = time.perf_counter() - t0
        if cuda:
            torch.cuda.empty_cache()
            result["weights_gib_per_gpu"] = torch.cuda.memory_allocated(device) / 2**30
        body = ForestBody(weights, graphs=False)  # collectives: eager, like Engine under TP
        logits = body.run(check).logits
        if reference is not None:
            result["bits_equal_to_one_gpu"] = bool(torch.equal(logits, reference))
            result["check_logits"] = list(logits.shape)
            del reference
        root = body.run(build_forest([Segment(root_tokens, None)])).states[0]
        bench = Bench(weights, root, str(device), g, body=body)

        def record(key: str, value: object) -> None:
            result[key] = value
            if rank == 0:
                show(key, value)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(result, f, indent=2)

        for key in list(result):
            record(key, result[key])
        if cuda:
            record("all_reduce_us", collective_latency(device))
        if args.profile:
            profile_one(bench, rank)
        run_workloads(bench, record, skip_long=args.skip_long, quick=args.quick)
        if cuda and not args.quick:
            record("peak_gib_per_gpu", torch.cuda.max_memory_allocated(device) / 2**30)
    finally:
        close_group()


def collective_latency(device: torch.device) -> dict[str, float]:
    """Mean microseconds of the all-reduces a row-parallel linear makes, at (a)'s 256 rows."""
    out = {}
    for name, t, op in (
        ("max_f32_256", torch.ones(256, device=device), dist.ReduceOp.MAX),
        ("sum_i32_256x5120", torch.ones(256, 5120, dtype=torch.int32, device=device), dist.ReduceOp.SUM),
    ):
        for _ in range(5):
            dist.all_reduce(t, op=op)
        sync()
        t0 = time.perf_counter()
        for _ in range(50):
            dist.all_reduce(t, op=op)
        sync()
        out[name] = 1e6 * (time.perf_counter() - t0) / 50
    return out


def profile_one(bench: Bench, rank: int) -> None:
    """Rank 0: where the time of one (a) request goes (CPU and GPU totals per op)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        bench.decide(220, 1)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        bench.decide(220, 1)
    if rank == 0:
        events = prof.key_averages()
        for key, rows in (("cpu_time_total", 14), ("self_cuda_time_total", 10)):
            print(events.table(sort_by=key, row_limit=rows, max_name_column_width=50), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="27B")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-long", action="store_true", help="skip the 8,192-token workload")
    ap.add_argument("--quick", action="store_true", help="the bit check and (a), (b) only")
    ap.add_argument("--profile", action="store_true", help="profile one (a) request on rank 0")
    args = ap.parse_args()
    if torch.cuda.is_available() and torch.cuda.device_count() < args.tp:
        raise SystemExit(f"--tp {args.tp} needs {args.tp} GPUs, this host has {torch.cuda.device_count()}")
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, args.tp, port, args)) for r in range(args.tp)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    if any(codes):
        raise SystemExit(f"ranks exited with {codes}")


if __name__ == "__main__":
    main()
