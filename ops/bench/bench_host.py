"""Host-side cost of one forest pass of the one-pass body (engine/run/body.py), at a model's real shape.

Everything a pass does on the CPU before its kernels run: building the forest, allocating each
segment's output block and its per-layer views, planning the tables, loading them into the
bucket (RoPE rows included). The body here lives on the CPU with weights it never reads, so no
GPU and no 27 GB of weights are needed; on a GPU the same Python runs, and it is time the GPU
waits for when the queue is empty. Median per pass over the workloads of bench_engine.py, and
the host part of one letter read-out with coverage:

    python ops/bench/bench_host.py --shape 27B
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from bench_engine import SHAPES, VOCAB, shape_config

from engine.decide.readout import fold_vocab_mass, read_letters, readout_from_letter_logits
from engine.kernels.vocab_mass import vocab_partials_reference
from engine.model.weights import Weights
from engine.quant.linear import QuantLinear
from engine.run.body import ForestBody
from engine.run.forest import Segment, SegmentState, build_forest

STAGES = ("build_forest", "allocate", "plan", "load")


def host_body(shape: str) -> ForestBody:
    """A CPU body of the shape's sizes whose only weight is a 1x1 LM head (the host path reads none)."""
    head = QuantLinear(torch.ones(1, 1, dtype=torch.int8), torch.ones(1))
    weights = Weights(shape_config(shape), torch.zeros(1, 1), torch.zeros(1), head)
    return ForestBody(weights, graphs=False)


def requests(root: SegmentState, evidence: int, questions: int, clients: int, g: torch.Generator):
    def tokens(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(0, VOCAB - 512, (n,), generator=g).tolist())

    segs: list[Segment] = []
    for _ in range(clients):
        segs.append(Segment(tokens(evidence), root))
        first = len(segs) - 1
        segs += [Segment(tokens(36), first, read=True) for _ in range(questions)]
    return segs


def time_pass(body: ForestBody, segs: list[Segment], n: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in STAGES}
    for _ in range(n):
        t0 = time.perf_counter()
        forest = build_forest(segs)
        t1 = time.perf_counter()
        states, blocks = body._allocate(forest)
        t2 = time.perf_counter()
        plan = body._plan(forest, states, blocks)
        t3 = time.perf_counter()
        bucket, _ = body._bucket(forest.num_tokens, len(forest.segments), plan.pieces.shape[2], plan.levels)
        body._load(bucket, plan)
        t4 = time.perf_counter()
        for key, dt in zip(STAGES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            times[key].append(dt)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def read_out_host_ms(vocab: int, n: int = 50) -> dict[str, float]:
    """Host ms per question of a letter read-out with coverage: the whole row summed on the host
    (`read_letters` on a CPU row; a CUDA row paid this plus a 1 MB copy before engine 0.2.0), and
    what is left on the host when the device sums it (`engine.kernels.vocab_mass`): folding the
    row's chunk partials and the letters' probabilities (the kernel and the small copy are GPU work)."""
    g = torch.Generator().manual_seed(2)
    row = torch.randn(vocab, generator=g) * 4
    letters = [100, 200, 300, 400]
    chunks = vocab_partials_reference(row).tolist()
    letter_logits = row[letters].tolist()

    def median_ms(fn) -> float:
        fn()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times)

    return {
        "row summed on the host": median_ms(lambda: read_letters(row, letters, 1.0)),
        "partials folded on the host": median_ms(
            lambda: (fold_vocab_mass(chunks), readout_from_letter_logits(letters, letter_logits, 1.0))
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="27B", choices=sorted(SHAPES))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)  # a serving process's host thread
    body = host_body(args.shape)
    g = torch.Generator().manual_seed(0)
    root_forest = build_forest([Segment(tuple(range(1000, 1027)), None)])
    root = body._allocate(root_forest)[0][0]  # the system prompt's state, as a cached parent
    workloads = {
        "a_one_question_256": (220, 1, 1, 30),
        "b_three_questions_256": (220, 3, 1, 30),
        "c_one_question_8192": (8156, 1, 1, 10),
        "d_64_clients": (220, 1, 64, 10),
    }
    result: dict = {"shape": args.shape}
    print(f"{'workload':<24}" + "".join(f"{k:>14}" for k in STAGES) + f"{'total ms':>12}")
    for name, (evidence, questions, clients, n) in workloads.items():
        segs = requests(root, evidence, questions, clients, g)
        time_pass(body, segs, 2)  # warm: buckets made, tables grown
        ms = time_pass(body, segs, n)
        result[name] = ms | {"total": sum(ms.values())}
        print(f"{name:<24}" + "".join(f"{ms[k]:>14.3f}" for k in STAGES) + f"{sum(ms.values()):>12.3f}")
    result["read_out"] = read_out_host_ms(shape_config(args.shape).vocab_size)
    for key, ms in result["read_out"].items():
        print(f"read-out, {key:<40}{ms:>12.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
