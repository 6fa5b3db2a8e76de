"""Host-side cost of one forest pass of the one-pass body (engine/run/body.py), at a model's real shape.

Everything a pass does on the host before its kernels run: building the forest, allocating each
segment's output block and its state, planning the tables, loading them into the bucket (RoPE
rows included), in both host forms (`engine.run.body.HOST_TABLES`: "lists", the session-10 path,
and "packed"), one after the other in one process, each on a body of its own. The body's only
weight is a 1x1 LM head it never reads, so no 27 GB of weights are needed: on the CPU (`--device
cpu`) it is the same Python the GPU's host runs, without the uploads; on a GPU (`--device cuda`)
the blocks are device memory and `load` includes the uploads and a sync (as `bench_engine.py
--wall-split`'s "host tables"). Median ms per pass over the workloads of bench_engine.py, then the
read-out: on the CPU its host part (`read_letters` of a CPU row, the fold of the device partials,
and everything `read_letters_many` does for a CUDA row after its copy back); on CUDA the wall a
read-out adds after a pass (a sleeping kernel stands in for the graph), each row alone with a sync
(`DEVICE_READ` "per_row") against every row queued at once ("batched").

    python ops/bench/bench_host.py --shape 27B [--device cuda] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from bench_engine import SHAPES, VOCAB, shape_config

from engine.decide import readout
from engine.decide.readout import fold_vocab_mass, read_letters, read_letters_many, readout_from_letter_logits
from engine.kernels.vocab_mass import vocab_partials_reference
from engine.model.weights import Weights
from engine.quant.linear import QuantLinear
from engine.run.body import HOST_TABLES, ForestBody
from engine.run.forest import Segment, SegmentState, build_forest

STAGES = ("build_forest", "allocate", "plan", "load")
WORKLOADS = {  # evidence tokens, questions, clients, timed passes
    "a_one_question_256": (220, 1, 1, 40),
    "b_three_questions_256": (220, 3, 1, 40),
    "c_one_question_8192": (8156, 1, 1, 10),
    "d_64_clients": (220, 1, 64, 6),
}
LETTERS = [100, 200, 300, 400]


def host_body(shape: str, device: str = "cpu") -> ForestBody:
    """A body of the shape's sizes on `device` whose only weight is a 1x1 LM head (the host path
    reads none)."""
    head = QuantLinear(torch.ones(1, 1, dtype=torch.int8, device=device), torch.ones(1, device=device))
    weights = Weights(
        shape_config(shape), torch.zeros(1, 1, device=device), torch.zeros(1, device=device), head
    )
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


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def one_pass(body: ForestBody, segs: list[Segment], device: str) -> list[float]:
    """Seconds of each stage of one pass's host side (the load's uploads synced on CUDA)."""
    sync(device)
    t0 = time.perf_counter()
    forest = build_forest(segs)
    t1 = time.perf_counter()
    states, blocks = body._allocate(forest)
    t2 = time.perf_counter()
    plan = body._plan(forest, states, blocks)
    t3 = time.perf_counter()
    bucket, _ = body._bucket(forest.num_tokens, len(forest.segments), plan.pieces.shape[2], plan.levels)
    body._load(bucket, plan)
    sync(device)
    t4 = time.perf_counter()
    return [t1 - t0, t2 - t1, t3 - t2, t4 - t3]


def time_forms(shape: str, device: str, workload: tuple[int, int, int, int]) -> dict[str, dict[str, float]]:
    """Median ms per stage for each host form, one after the other as a serving process runs one:
    each on its own body and system root (made by that form), the same forest, 2 warm passes."""
    evidence, questions, clients, n = workload
    out = {}
    for form in HOST_TABLES:
        body = host_body(shape, device)
        body.host_tables = form
        root = body._allocate(build_forest([Segment(tuple(range(1000, 1027)), None)]))[0][0]
        segs = requests(root, evidence, questions, clients, torch.Generator().manual_seed(0))
        passes = [one_pass(body, segs, device) for _ in range(n + 2)][2:]
        ms = {stage: 1e3 * statistics.median(p[i] for p in passes) for i, stage in enumerate(STAGES)}
        out[form] = ms | {"total": sum(ms.values())}
        del body, root, segs, passes
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def median_ms(fn: Callable[[], object], n: int = 50) -> float:
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def read_out_host_ms(vocab: int) -> dict[str, float]:
    """Host ms per question of a letter read-out with coverage: the whole row summed on the host
    (`read_letters` on a CPU row; a CUDA row paid this plus a 1 MB copy before engine 0.2.0), and
    what is left on the host when the device sums it (`engine.kernels.vocab_mass`): folding the
    row's chunk partials and the letters' probabilities (the kernel and the small copy are GPU work)."""
    g = torch.Generator().manual_seed(2)
    row = torch.randn(vocab, generator=g) * 4
    chunks = vocab_partials_reference(row).tolist()
    flat = [v for c in chunks for v in c]  # as a device read-out copies them back
    letter_logits = row[LETTERS].tolist()

    def after_copy() -> object:  # what `read_letters_many` runs for a CUDA row after its sync
        return readout._letter_readout(LETTERS, letter_logits, 1.0, readout._fold_flat(flat, 0, len(flat)))

    return {
        "row summed on the host": median_ms(lambda: read_letters(row, LETTERS, 1.0)),
        "partials folded on the host": median_ms(
            lambda: (fold_vocab_mass(chunks), readout_from_letter_logits(LETTERS, letter_logits, 1.0))
        ),
        "device row's host part after the copy": median_ms(after_copy, n=500),
    }


def read_out_cuda_ms(vocab: int, pass_ms: float = 5.0, n: int = 30) -> dict[str, float]:
    """The wall a stage's read-outs add after the pass that made their rows (R = 1 and 3 rows):
    a sleeping kernel of ~pass_ms stands in for the graph; its wall alone is subtracted."""
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(3, vocab, generator=g) * 4).cuda()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    cycles = int(1_000_000 * pass_ms / start.elapsed_time(end))

    def walled(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(n + 3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.cuda._sleep(cycles)
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times[3:])

    alone = walled(lambda: None)
    out = {"pass_ms": alone}
    for rows in (1, 3):
        for form in readout.DEVICE_READS:
            readout.DEVICE_READ = form
            ms = walled(
                lambda rows=rows: read_letters_many(list(logits[:rows]), [LETTERS] * rows, [1.0] * rows)
            )
            out[f"{rows} row(s), {form}"] = ms - alone
    readout.DEVICE_READ = readout.DEVICE_READS[0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="27B", choices=sorted(SHAPES))
    ap.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda")
    )
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {', '.join(WORKLOADS)}")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)  # a serving process's host thread
    result: dict = {"shape": args.shape, "device": args.device}
    head = f"{'workload':<24}{'form':<8}" + "".join(f"{k:>14}" for k in STAGES) + f"{'total ms':>12}"
    print(head)
    for name in args.workloads.split(","):
        result[name] = forms = time_forms(args.shape, args.device, WORKLOADS[name])
        for form, ms in forms.items():
            print(
                f"{name:<24}{form:<8}" + "".join(f"{ms[k]:>14.3f}" for k in STAGES) + f"{ms['total']:>12.3f}"
            )
    vocab = shape_config(args.shape).vocab_size
    result["read_out"] = read_out_host_ms(vocab)
    if args.device == "cuda":
        result["read_out_cuda"] = read_out_cuda_ms(vocab)
    for section in ("read_out", "read_out_cuda"):
        for key, ms in result.get(section, {}).items():
            print(f"{section}, {key:<40}{ms:>12.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
