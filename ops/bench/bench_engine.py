"""GPU engine benchmark at real StartLux-Decision shapes (4B, 9B, 27B) on the int8 path.

Builds a qwen35 model of the given shape with random int8 weights directly on the GPU (no
GGUF needed: the arithmetic and the bytes moved are what a real Q8_0 file requantized at
startup gives), then runs the seed's workloads through the one-pass forest body (`engine.run.body`,
a CUDA graph per bucket; `--levels`: the level-by-level executor) exactly as `Engine.decide`
does (system root computed once, evidence segment, question segments, letter read-out over
the full vocabulary):

  (a) one question, ~256 tokens                      serial, mean / p50 / p99 latency
  (b) three questions sharing ~256 tokens of evidence serial, mean / p50 / p99 latency
      and the README's three questions (the seed's (b): `README_B`, 29 + 34 + 41 + 56 tokens)
  (c) one question, ~8,192 tokens                    serial, mean / p50 / p99 latency
  (d) 64 concurrent clients, read-outs only          64 one-question requests per batch, req/s
  (e) thought decoding: 1 sequence and 64 sequences  tokens/s, through `engine.run.decoder` (one
      CUDA graph per bucket) and the batched sampler, as `engine.thoughts.think` runs it on CUDA
  (f) --thinking: a thinking request end to end    mean / p99 ms at 1 and 16 concurrent: read-out,
      thinking read, a forced 128-token thought, closing tokens, second read-out

Serial workloads run 25 requests and discard the first 5; every request carries unique random
evidence. Token ids are random: tokenization and prompt rendering (CPU, ~1 ms) are not timed.

    python ops/bench/bench_engine.py --shape 27B --json out.json
    python ops/bench/bench_engine.py --shape 27B --decode-only     # workload (e) alone
    python ops/bench/bench_engine.py --shape 27B --variants body,levels,tc   # one weight build
    python ops/bench/bench_engine.py --shape 27B --variants body,tc --peer --skip-decode
    python ops/bench/bench_engine.py --shape 4B --accuracy            # settings vs the fp32 path

`--peer`: after our variants, in the same process, HF transformers `Qwen3_5ForCausalLM` in bf16
at the same shape (random weights, SDPA attention, fla-core's GDN kernels when `fla` imports,
`logits_to_keep=1`, no KV cache: a read-out is one forward) runs (a), (b) as one batch of three
padded prompts (it has no shared-prefix forest) and (c), timed the same way; the JSON holds its
numbers under "peer" and each variant's `vs_peer` (peer mean / ours: > 1 means we are faster).

`--accuracy`: every body setting that is not bit-exact by construction (tensor-core attention
dots, the chunked GDN) and the exact body itself against the fp32 reference path (the level
executor over the same weights dequantized to fp32) on the same forests: argmax agreement over
the read-outs whose fp32 top-two margin is >= 0.1, and the largest |delta p| of a letter
probability. 4B by default of the caller: 27B's fp32 copy would not fit beside the int8 one.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from engine import thoughts
from engine.decide import readout
from engine.decide.readout import read_letters, read_letters_many
from engine.decide.sampling import sample_tokens, thought_key, uniform
from engine.kernels import cutlass_gemm
from engine.kernels.draw import DrawSettings
from engine.kernels.forest_attention import ATTENTION_DOTS
from engine.kernels.forest_gdn import GDN_DOTS
from engine.model.config import ModelConfig
from engine.model.weights import Weights
from engine.quant.linear import QuantLinear
from engine.run.body import HOST_TABLES, ForestBody
from engine.run.decoder import Decoder
from engine.run.executor import ForestOutput, run_forest
from engine.run.forest import Forest, Segment, SegmentState, build_forest

VOCAB = 248_320
DRAW = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}  # the decision config's thought sampler
SHAPES: dict[str, dict] = {
    "4B": dict(hidden_size=2560, num_layers=32, intermediate_size=9216, num_attention_heads=16,
               num_kv_heads=4, linear_num_value_heads=32, tied_embeddings=True),
    "9B": dict(hidden_size=4096, num_layers=32, intermediate_size=12288, num_attention_heads=16,
               num_kv_heads=4, linear_num_value_heads=32, tied_embeddings=False),
    "tiny": dict(hidden_size=256, num_layers=4, intermediate_size=512, num_attention_heads=4,
                 num_kv_heads=2, linear_num_value_heads=32, tied_embeddings=False),
    "27B": dict(hidden_size=5120, num_layers=64, intermediate_size=17408, num_attention_heads=24,
                num_kv_heads=4, linear_num_value_heads=48, tied_embeddings=False),
}  # fmt: skip
LETTERS = list(range(32, 32 + 26))  # token ids of A..Z in the Qwen3.5 vocabulary
# The seed's workload (b) is "README's three questions". Ours, `b_three_questions_256`, is three
# 36-token questions after 220 tokens of evidence (328 rows a pass, a 384-row bucket): heavier
# than the (a) it is compared with, while the published (b) (17.4 ms) is lighter than its (a)
# (19.0). `README_B` is the example event README.md shows ("The event format"), rendered by the
# engine's prompt (`engine.model.prompt.PromptEncoder`, the StartLux vocabulary): its evidence
# segment and its three question segments, in tokens (the system prompt is the root, computed at
# startup). Numbers here so the GPU machine needs no tokenizer;
# tests/ops/test_bench_workloads.py renders the README's example again and checks them.
README_B = "b_readme_three_questions"
README_EVIDENCE_TOKENS = 29
README_QUESTION_TOKENS = (34, 41, 56)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def shape_config(name: str) -> ModelConfig:
    return ModelConfig(
        vocab_size=VOCAB,
        head_dim=256,
        rope_dims=64,
        rope_theta=1e7,
        rms_norm_eps=1e-6,
        full_attention_interval=4,
        linear_num_key_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        conv_kernel=4,
        **SHAPES[name],
    )


def random_int8_linear(out_features: int, in_features: int, g: torch.Generator, device: str) -> QuantLinear:
    q = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, device=device, generator=g)
    # uniform int8 has std ~73: scale so that y = x @ W.T keeps unit-variance inputs at unit variance
    scale = torch.full((out_features,), 1.0 / (73.3 * in_features**0.5), device=device)
    return QuantLinear(q, scale, None)


def random_weights(config: ModelConfig, device: str, seed: int = 0) -> Weights:
    g = torch.Generator(device=device).manual_seed(seed)
    c = config
    h = c.hidden_size

    def lin(n: int, k: int) -> QuantLinear:
        return random_int8_linear(n, k, g, device)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device)

    layers = []
    for i in range(c.num_layers):
        layer: dict = {
            "attn_norm": ones(h),
            "post_attention_norm": ones(h),
            "ffn_gate": lin(c.intermediate_size, h),
            "ffn_up": lin(c.intermediate_size, h),
            "ffn_down": lin(h, c.intermediate_size),
        }
        if c.is_full_attention(i):
            nh, nkv, hd = c.num_attention_heads, c.num_kv_heads, c.head_dim
            layer |= {
                "attn_q": lin(2 * nh * hd, h),
                "attn_k": lin(nkv * hd, h),
                "attn_v": lin(nkv * hd, h),
                "attn_output": lin(h, nh * hd),
                "attn_q_norm": ones(hd),
                "attn_k_norm": ones(hd),
            }
        else:
            nv = c.linear_num_value_heads
            layer |= {
                "attn_qkv": lin(c.conv_dim, h),
                "attn_gate": lin(c.linear_value_dim, h),
                "ssm_beta": lin(nv, h),
                "ssm_alpha": lin(nv, h),
                "ssm_conv1d": torch.randn(c.conv_dim, c.conv_kernel, device=device, generator=g) * 0.5,
                "ssm_dt": torch.zeros(nv, device=device),
                "ssm_a": -torch.rand(nv, device=device, generator=g) * 2.0 - 0.1,
                "ssm_norm": ones(c.linear_value_head_dim),
                "ssm_out": lin(h, c.linear_value_dim),
            }
        layers.append(layer)
    embd = torch.randn(VOCAB, h, device=device, generator=g)
    output = lin(VOCAB, h)
    return Weights(config=c, token_embd=embd, output_norm=ones(h), output=output, layers=layers)


@dataclass
class Bench:
    weights: Weights
    root: SegmentState
    device: str
    g: torch.Generator
    graphs: bool | None = None  # None: CUDA graphs on CUDA
    body: ForestBody | None = None  # None: the level-by-level executor
    _decoder: Decoder | None = None

    def run(self, forest: Forest) -> ForestOutput:
        if self.body is not None:
            return self.body.run(forest)
        return run_forest(self.weights, forest)

    def tokens(self, n: int) -> tuple[int, ...]:
        return tuple(torch.randint(0, VOCAB - 512, (n,), generator=self.g).tolist())

    def decide(
        self,
        evidence_tokens: int,
        questions: int | Sequence[int],
        question_tokens: int = 36,
        *,
        draw_timed: bool = False,
    ) -> float:
        """One request: evidence + questions in one forest, letter read-outs; returns seconds.
        `questions`: how many of `question_tokens` tokens each, or each question's length.
        Timed from the token ids (drawn before the clock starts, as a tokenizer's output would
        arrive; until session 20 the draw was timed too, ~0.1-0.3 ms on the device host: `draw_timed`
        times it as before, for the record that compares the two)."""
        lengths = [question_tokens] * questions if isinstance(questions, int) else list(questions)
        reads = len(lengths)
        sync()
        t0 = time.perf_counter()
        evidence, asked = self.tokens(evidence_tokens), [self.tokens(n) for n in lengths]
        if not draw_timed:
            sync()
            t0 = time.perf_counter()
        segs = [Segment(evidence, self.root)]
        segs += [Segment(tokens, 0, read=True) for tokens in asked]
        out = self.run(build_forest(segs))
        read_letters_many(list(out.logits[:reads]), [LETTERS[:4]] * reads, [1.0] * reads)
        sync()
        return time.perf_counter() - t0

    def batch(self, clients: int, evidence_tokens: int, question_tokens: int = 36) -> float:
        """`clients` requests of one question in one forest (workload (d)); timed as `decide`."""
        drawn = [(self.tokens(evidence_tokens), self.tokens(question_tokens)) for _ in range(clients)]
        sync()
        t0 = time.perf_counter()
        segs: list[Segment] = []
        for evidence, question in drawn:
            segs.append(Segment(evidence, self.root))
            segs.append(Segment(question, len(segs) - 1, read=True))
        out = self.run(build_forest(segs))
        read_letters_many(list(out.logits[:clients]), [LETTERS[:4]] * clients, [1.0] * clients)
        sync()
        return time.perf_counter() - t0

    def decode(self, sequences: int, steps: int, prompt_tokens: int = 256) -> float:
        """Tokens/s of one-token steps for `sequences` thoughts, each from its own prompt.

        Each step is what `engine.thoughts.think` does on CUDA (`thought_steps`: a decoder step,
        graph replay or eager with --decode-eager, and the batched sampler at the decision config's
        defaults, running ahead where the loop does); the first draw, from the prompt's read, is
        made before the clock starts.
        """
        segs = [Segment(self.tokens(prompt_tokens), self.root, read=True) for _ in range(sequences)]
        out = self.run(build_forest(segs))
        decoder = self.decoder()
        seqs = [decoder.start(st, steps) for st in out.states]
        keys = [thought_key(i, f"bench-{sequences}", []) for i in range(sequences)]
        tokens = sample_tokens(out.logits, [uniform(key, 0) for key in keys], **DRAW)
        sync()
        t0 = time.perf_counter()
        thought_steps(decoder, seqs, tokens, keys, steps)
        sync()
        return sequences * steps / (time.perf_counter() - t0)

    def decoder(self) -> Decoder:
        if self._decoder is None:
            dots = self.body.attention_dots if self.body is not None else "ieee"
            self._decoder = Decoder(self.weights, graphs=self.graphs, attention_dots=dots)
            # the sampler's settings below (its device part made in the step where TOP_K_IN_STEP
            # or DRAW_IN_STEP is on)
            self._decoder.sample_with(DrawSettings(20, 0.6, 0.95))
        return self._decoder


def show(key: str, value: object) -> None:
    text = (
        json.dumps(value)
        if isinstance(value, dict)
        else (f"{value:.3f}" if isinstance(value, float) else value)
    )
    print(f"{key:<24}  {text}", flush=True)


def kernel_family(name: str) -> str:
    """The family a GPU kernel's time is charged to in a profile summary (by kernel name)."""
    n = name.lower()
    for family, keys in (
        ("gemm", ("gemm", "matmul", "_int_mm", "cutlass", "wgmma")),
        ("attention", ("attention", "attn")),
        ("gdn", ("gdn", "delta", "conv")),
        ("norm_quant", ("norm", "quant", "swiglu", "silu", "rope")),
        ("copy", ("copy", "memcpy", "memset", "cat", "fill")),
    ):
        if any(k in n for k in keys):
            return family
    return "other"


def set_constant(assignment: str) -> object:
    """`--set MODULE.NAME=VALUE`: a module constant (a kernel setting) set before anything runs,
    VALUE read as a Python literal; the name must exist, so a typo cannot time the default.
    Returns the value it replaced (a variant's `"set"` puts it back after the variant)."""
    import ast

    target, _, text = assignment.partition("=")
    module_name, _, name = target.strip().rpartition(".")
    module = importlib.import_module(module_name)
    if not name or not hasattr(module, name):
        raise SystemExit(f"--set {assignment}: {module_name} has no {name!r}")
    before = getattr(module, name)
    setattr(module, name, ast.literal_eval(text.strip()))
    show(f"set {module_name}.{name}", getattr(module, name))
    return before


def profile_workload(bench: Bench, label: str, fn: Callable[[], float], path: str | None) -> None:
    """Per-kernel breakdown of one workload: where the GPU time goes, by kernel and by family.

    Runs the workload on an eager twin of the bench's body (the same settings and kernels, no
    graph: the profiler then names every kernel) after three warm calls; also shows the graphed
    wall time beside it, so launch overhead is the difference."""
    from torch.profiler import ProfilerActivity, profile

    graphed_ms = 1e3 * statistics.fmean(fn() for _ in range(3))
    body = bench.body
    if body is not None and body.graphs:
        bench.body = ForestBody(
            bench.weights, graphs=False, gdn_chunk=body.gdn_chunk, gdn_dots=body.gdn_dots,
            attention_dots=body.attention_dots, gdn_prep=body.gdn_prep, last_layer=body.last_layer,
            read_splits=body.read_splits,
        )  # fmt: skip
        bench.body.read_out_letters(LETTERS)
    try:
        for _ in range(3):
            fn()
        with (
            gemm_ranges() as weights_seen,
            profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof,
        ):
            wall = fn()
    finally:
        bench.body = body
    # the GEMM ranges carry their kernels' GPU time as well: busy time and families count kernels
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0 and e.key not in weights_seen]
    gpu_us = sum(e.self_device_time_total for e in events)
    families: dict[str, float] = {}
    for e in events:
        fam = kernel_family(e.key)
        families[fam] = families.get(fam, 0.0) + e.self_device_time_total / 1e3
    launch_keys = ("cudaLaunchKernel", "cuLaunchKernel")
    launches = sum(e.count for e in prof.key_averages() if e.key.startswith(launch_keys))
    show(f"{label}_profile_graphed_ms", graphed_ms)
    show(f"{label}_profile_eager_wall_ms", 1e3 * wall)
    show(f"{label}_profile_gpu_busy_ms", gpu_us / 1e3)
    show(f"{label}_profile_launches", launches)
    ranked = sorted(families.items(), key=lambda kv: -kv[1])
    show(f"{label}_profile_families_ms", {k: round(v, 3) for k, v in ranked})
    show(f"{label}_profile_gemm_ranges", gemm_range_rates(prof.key_averages(), weights_seen, steps=1))
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=24, max_name_column_width=70)
    print(table, flush=True)
    if path:
        with open(f"{path}.{label}.txt", "w") as f:
            f.write(table)


def profile_prefill(bench: Bench, path: str | None, *, skip_long: bool) -> None:
    """Profiles of (a), (b) (both forms) and (c) (as `run_workloads` times them)."""
    profile_workload(bench, "a", lambda: bench.decide(220, 1), path)
    profile_workload(bench, "b", lambda: bench.decide(220, 3), path)
    readme = (README_EVIDENCE_TOKENS, README_QUESTION_TOKENS)
    profile_workload(bench, "b_readme", lambda: bench.decide(*readme), path)
    if not skip_long:
        profile_workload(bench, "c", lambda: bench.decide(8156, 1), path)


def profile_decode(bench: Bench, sequences: int, path: str | None) -> None:
    """Where a decode step's time goes: graph replay alone, the sampler alone, and the kernels
    of the same step run eagerly (per-kernel GPU time; the graph runs exactly these kernels)."""
    from torch.profiler import ProfilerActivity, profile

    segs = [Segment(bench.tokens(256), bench.root, read=True) for _ in range(sequences)]
    out = bench.run(build_forest(segs))
    graphed = bench.decoder()
    eager = Decoder(bench.weights, graphs=False, attention_dots=graphed.attention_dots)
    tokens = [7] * sequences
    us = [0.5] * sequences
    for decoder, name in ((graphed, "graph"), (eager, "eager")):
        seqs = [decoder.start(st, 24) for st in out.states]
        logits = decoder.step(seqs, tokens, us)
        sync()
        t0 = time.perf_counter()
        for _ in range(16):
            logits = decoder.step(seqs, tokens, us)
        sync()
        show(f"e_profile_{sequences}_{name}_step_ms", 1e3 * (time.perf_counter() - t0) / 16)
    t0 = time.perf_counter()
    for _ in range(16):
        sample_tokens(logits, us, **DRAW)
    show(f"e_profile_{sequences}_sampler_ms", 1e3 * (time.perf_counter() - t0) / 16)
    # the sampler's device part alone (top-k and the count at the cut), and the step's host part
    sync()
    t0 = time.perf_counter()
    for _ in range(16):
        kth = torch.topk(logits, 20, dim=-1).values[:, -1:]
        (logits >= kth).sum(dim=-1)
    sync()
    show(f"e_profile_{sequences}_topk_ms", 1e3 * (time.perf_counter() - t0) / 16)
    bucket = graphed._bucket(next(b for b in graphed.buckets if b >= sequences))
    live = [graphed.start(st, 24) for st in out.states]
    t0 = time.perf_counter()
    for _ in range(16):
        graphed._load(bucket, live, tokens)
    sync()
    show(f"e_profile_{sequences}_load_ms", 1e3 * (time.perf_counter() - t0) / 16)
    seqs = [eager.start(st, 24) for st in out.states]
    eager.step(seqs, tokens)
    with (
        gemm_ranges() as weights_seen,
        profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof,
    ):
        for _ in range(4):
            eager.step(seqs, tokens)
        sync()
    events = prof.key_averages()
    table = events.table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60)
    # the GEMM ranges carry their kernels' GPU time as well (a GPU-side annotation): the busy
    # time counts the kernels only
    busy = sum(e.self_device_time_total for e in events if e.key not in weights_seen)
    show(f"e_profile_{sequences}_gpu_busy_ms_per_step", busy / 4e3)
    print(table, flush=True)
    show(f"e_profile_{sequences}_gemm_ranges", gemm_range_rates(events, weights_seen, steps=4))
    if path:
        with open(f"{path}.{sequences}.txt", "w") as f:
            f.write(table)


def decode_sequences(spec: str) -> list[int]:
    """Workload (e)'s sequence counts from a comma list ("1,64"; "32" for the 32-row bucket)."""
    counts = [int(x) for x in spec.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        raise SystemExit(f"--decode-sequences needs positive counts, got {spec!r}")
    return counts


def gemm_range_rates(events: list, weights_seen: dict[str, dict], *, steps: int) -> dict[str, dict]:
    """Each GEMM shape's GPU time inside the real step or pass (its range's kernels), its weight's
    bytes over that time (what bounds a decode step's GEMMs), its int8 operations over that time
    (what bounds a prefill's) and the weight's layout: what bench_cutlass.py's cold, fresh
    weights give for the same shape is the comparison. A range can appear twice in the profile (its host-side
    event and its GPU-side annotation, only one of which carries the kernels' time): the larger
    is taken, and a range whose kernels left no GPU time is reported without a rate."""
    out: dict[str, dict] = {}
    for key in sorted(weights_seen):
        mine = [e for e in events if e.key == key]
        if not mine:
            continue
        best = max(mine, key=lambda e: e.device_time_total)
        calls = max(e.count for e in mine)
        us = best.device_time_total / best.count if best.count else 0.0
        weight = weights_seen[key]
        rate = round(weight["n"] * weight["k"] / us / 1e6, 3) if us > 0 else None  # bytes/us -> TB/s
        ops = 2 * weight["m"] * weight["n"] * weight["k"]
        tops = round(ops / us / 1e6, 1) if us > 0 else None  # ops/us -> TOP/s
        row = {"us": round(us, 2), "calls_per_step": calls / steps, "tb_per_s": rate, "top_per_s": tops}
        out[key] = row | weight
    return out


@contextlib.contextmanager
def gemm_ranges() -> Iterator[dict[str, dict]]:
    """While open, every call of the engine's GEMM entry points (`engine.kernels.int8_gemm`,
    `int8_gemm_swiglu`, `int8_gemm_swiglu_quantize`: every int8 linear a pass or step launches)
    runs inside a profiler range named by its shape ("gemm M=.. N=.. K=..", then "+res" where a
    residual is added, " swiglu" / " swiglu+quant" for the MLP's fused forms), so a profile
    charges each shape its kernels' GPU time; yields {range: the weight's layout}."""
    from engine import kernels

    suffixes = {"int8_gemm": "", "int8_gemm_swiglu": " swiglu", "int8_gemm_swiglu_quantize": " swiglu+quant"}
    saved = {name: getattr(kernels, name) for name in suffixes}
    seen: dict[str, dict] = {}

    def ranged(name: str, fn: Callable) -> Callable:
        def call(a: torch.Tensor, w: torch.Tensor, *rest: object, **kw: object) -> object:
            res = "+res" if name == "int8_gemm" and len(rest) > 2 and rest[2] is not None else ""
            key = f"gemm M={a.shape[0]} N={w.shape[0]} K={w.shape[1]}{res}{suffixes[name]}"
            layout = {
                "contiguous": w.is_contiguous(),
                "stride": list(w.stride()),
                "ptr_mod_256": w.data_ptr() % 256,
            }
            seen.setdefault(key, {"m": a.shape[0], "n": w.shape[0], "k": w.shape[1]} | layout)
            with torch.profiler.record_function(key):
                return fn(a, w, *rest, **kw)

        return call

    for name, fn in saved.items():
        setattr(kernels, name, ranged(name, fn))
    try:
        yield seen
    finally:
        for name, fn in saved.items():
            setattr(kernels, name, fn)


# (f) a thinking request end to end, as engine.stages.Stages._decide_stages / _think run it on CUDA int8:
# first read-out (evidence + question), the thinking read (the question + `<think>\n` from the
# cached evidence state), a thought forced to THOUGHT_TOKENS tokens (drawn by the sampler, no
# early `</think>`: lengths comparable between runs), the closing tokens fed one per step, and
# the second read-out. The seed's figure: 1,150 ms (int8) / 1,212 ms per thinking request.
THOUGHT_TOKENS = 128
THINK_OPEN, THINK_CLOSE = 2, 3  # `<think>\n` and `</think>\n\n` (token counts; random ids here)


def thought_steps(
    decoder: Decoder, seqs: list, tokens: list[int], keys: list[bytes], steps: int
) -> torch.Tensor:
    """`steps` decoder steps of a thought loop's work (`engine.thoughts.think`): the first fed
    `tokens`, each later one the token drawn from the step before (each step given its rows'
    uniforms for that draw, hashed from the thought keys as the loop does). Where the loop runs
    ahead (`thoughts.RUN_AHEAD` with the draw in the step) each step is queued fed the previous
    step's own draws, and those are read while it runs; else the host reads each step's draws
    before queuing the next. The last step's logits, its draws unread."""
    ahead = thoughts.RUN_AHEAD and decoder.draws_in_step()
    logits, previous = None, []
    for step in range(1, steps + 1):
        us = [uniform(key, step) for key in keys]  # the draw this step makes
        if ahead and logits is not None:
            queued = decoder.step(seqs, [None] * len(seqs), us)
            sample_tokens(logits, previous, **DRAW)  # what the loop reads meanwhile
            logits = queued
        else:
            logits = decoder.step(seqs, tokens, us)
            if not ahead and step < steps:
                tokens = sample_tokens(logits, us, **DRAW)
        previous = us
    assert logits is not None
    return logits


def thinking_requests(bench: Bench, clients: int, thought_tokens: int = THOUGHT_TOKENS) -> float:
    """`clients` concurrent thinking requests (~256 evidence + question tokens each); returns the
    seconds until the last second read-out (they run in lockstep, so each one's latency)."""
    sync()
    t0 = time.perf_counter()
    segs: list[Segment] = []
    for _ in range(clients):
        segs.append(Segment(bench.tokens(220), bench.root))
        segs.append(Segment(bench.tokens(36), len(segs) - 1, read=True))
    forest = build_forest(segs)
    first = bench.run(forest)
    for row in range(clients):
        read_letters(first.logits[row], LETTERS[:4], 1.0)
    evidence = [first.states[forest.packed_index[2 * i]] for i in range(clients)]
    think = bench.run(
        build_forest([Segment(bench.tokens(36 + THINK_OPEN), ev, read=True) for ev in evidence])
    )
    decoder = bench.decoder()
    seqs = [decoder.start(st, thought_tokens + THINK_CLOSE) for st in think.states]
    keys = [thought_key(i, f"thinking-{clients}", []) for i in range(clients)]
    tokens = sample_tokens(think.logits, [uniform(key, 0) for key in keys], **DRAW)
    thought_steps(decoder, seqs, tokens, keys, thought_tokens)
    for token in bench.tokens(THINK_CLOSE):
        logits = decoder.step(seqs, [token] * clients)
    for row in range(clients):
        read_letters(logits[row], LETTERS[:4], 1.0)
    sync()
    elapsed = time.perf_counter() - t0
    decoder.forget()
    return elapsed


def run_thinking(
    bench: Bench, record: Callable[[str, object], None], runs: int = 6, concurrency: tuple[int, ...] = (1, 16)
) -> None:
    """Workload (f): mean and p99 latency of a thinking request at 1 and 16 concurrent (after one
    warm-up batch, which compiles and captures; p99 over every request of `runs` batches)."""
    for clients in concurrency:
        thinking_requests(bench, clients, 4)
        times = [thinking_requests(bench, clients) for _ in range(runs)]
        per_request = sorted(t for t in times for _ in range(clients))
        p99 = per_request[min(len(per_request) - 1, int(0.99 * len(per_request)))]
        record(
            f"f_thinking_{clients}",
            {"mean_ms": 1e3 * statistics.fmean(times), "p99_ms": 1e3 * p99, "thought_tokens": THOUGHT_TOKENS},
        )


def run_workloads(
    bench: Bench,
    record: Callable[[str, object], None],
    *,
    skip_long: bool = False,
    quick: bool = False,
) -> None:
    """The seed's workloads (a)-(d) as the module docstring describes them; quick: (a) and (b)."""
    record("a_one_question_256", serial(lambda: bench.decide(220, 1)))
    # (a) as sessions 1-19 timed it, the bench's token draw inside the clock
    record("a_timed_with_token_draw", serial(lambda: bench.decide(220, 1, draw_timed=True)))
    record("b_three_questions_256", serial(lambda: bench.decide(220, 3)))
    record(README_B, serial(lambda: bench.decide(README_EVIDENCE_TOKENS, README_QUESTION_TOKENS)))
    if quick:
        return
    if not skip_long:
        record("c_one_question_8192", serial(lambda: bench.decide(8156, 1), n=10, warmup=2))
    bench.batch(64, 220)
    times = [bench.batch(64, 220) for _ in range(3)]
    record("d_64_clients_req_per_s", 64 / statistics.median(times))


def wall_split(bench: Bench, evidence_tokens: int, questions: int, question_tokens: int = 36) -> dict:
    """Where one request's wall time goes, on the graphed body (ms, median of 20): the host's
    table work alone (build the forest, allocate the outputs, plan, load the bucket), the bucket's
    graph replay alone (CUDA events: the GPU's time including the gaps between its kernels),
    `body.run` with a sync, the read-outs alone after the pass (GPU idle; their profile printed:
    host ops and kernels), and the whole `decide` (read-outs included). The eager profile's GPU
    busy time leaves out the gaps between kernels; this says how large they are."""
    body = bench.body
    assert body is not None and body.graphs

    def forest() -> Forest:
        segs = [Segment(bench.tokens(evidence_tokens), bench.root)]
        segs += [Segment(bench.tokens(question_tokens), 0, read=True) for _ in range(questions)]
        return build_forest(segs)

    def host() -> float:
        t0 = time.perf_counter()
        load_tables(body, forest())
        sync()
        return time.perf_counter() - t0

    def run() -> float:
        f = forest()
        sync()
        t0 = time.perf_counter()
        body.run(f)
        sync()
        return time.perf_counter() - t0

    f = forest()
    bench.decide(evidence_tokens, questions)  # the bucket's graph exists from here on
    states, blocks = body._allocate(f)
    plan = body._plan(f, states, blocks)
    bucket, _ = body._bucket(f.num_tokens, len(f.segments), plan.pieces.shape[2], plan.levels)
    assert bucket.graph is not None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replays = []
    for _ in range(20):
        start.record()
        bucket.graph.replay()
        end.record()
        end.synchronize()
        replays.append(start.elapsed_time(end) / 1e3)

    def read_out(around: Callable[[], AbstractContextManager] = contextlib.nullcontext) -> float:
        """The read-outs alone (inside `around`), started on an idle GPU after the pass: what
        `decide` adds after `body.run`."""
        logits = body.run(forest()).logits[:questions]
        sync()
        with around():
            t0 = time.perf_counter()
            read_letters_many(list(logits), [LETTERS[:4]] * questions, [1.0] * questions)
            return time.perf_counter() - t0

    read_out_ms = 1e3 * statistics.median(read_out() for _ in range(20))
    steps = host_steps(body, forest, questions)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # whether torch's CPU thread pool is what the host steps wait on
    try:
        steps_one_thread = host_steps(body, forest, questions)
    finally:
        torch.set_num_threads(threads)
    print_host_profile(body, forest)
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    read_out(lambda: prof)  # the pass before it is not profiled: only the read-out
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=16, max_name_column_width=60))
    return {
        "tokens_bucket": bucket.tokens,
        "host_tables_ms": 1e3 * statistics.median(host() for _ in range(20)),
        "read_out_ms": read_out_ms,
        "graph_replay_ms": 1e3 * statistics.median(replays),
        "body_run_ms": 1e3 * statistics.median(run() for _ in range(20)),
        "decide_ms": 1e3 * statistics.median(bench.decide(evidence_tokens, questions) for _ in range(20)),
        "steps_us": steps,
        "torch_threads": threads,
        "steps_us_one_thread": steps_one_thread,
    }


def load_tables(body: ForestBody, f: Forest) -> None:
    """What `body.run` does on the host before its replay: allocate, plan, find the bucket, load."""
    states, blocks = body._allocate(f)
    plan = body._plan(f, states, blocks)
    bucket, _ = body._bucket(f.num_tokens, len(f.segments), plan.pieces.shape[2], plan.levels)
    body._load(bucket, plan)


def print_host_profile(body: ForestBody, forest: Callable[[], Forest], passes: int = 50) -> None:
    """cProfile of the host's table steps (build the forest, allocate, plan, bucket, load) over
    `passes` passes with the GPU idle: which calls the ~1 ms before a replay is made of on the
    machine that runs the bench (its Python runs several times slower than a dev box's)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(passes):
        load_tables(body, forest())
        sync()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    print(f"host table steps, {passes} passes (cProfile, tottime):\n{text.getvalue()}", flush=True)


def host_steps(body: ForestBody, forest: Callable[[], Forest], reads: int) -> dict[str, float]:
    """The host's time in each step of one graphed pass and its read-outs (us, median of 20, from
    an idle GPU): what `body.run` and `read_letters_many` do, step by step, each timed to its
    return (kernels queued, not finished), then the wait for the GPU and the copy back. Also one
    read-out kernel's launch alone: first after an idle GPU, then right behind another, then
    behind a queued graph replay: a launch that costs more after the graph than behind another
    kernel is a driver cost (not the kernel), which an in-graph read-out would remove. Last, a
    fixed pure-Python loop (`python_loop`): how fast this host runs the plan's kind of code."""
    from engine.kernels.vocab_mass import CHUNK, FIELDS, vocab_partials

    names = ["forest", "allocate", "plan", "bucket", "load", "replay", "clone", "gpu_wait"]
    names += ["partials_launches", "letters_gathers", "copy_back", "fold"]
    names += ["launch_idle", "launch_behind_kernel", "launch_behind_graph", "python_loop"]
    times: dict[str, list[float]] = {n: [] for n in names}
    index = torch.tensor(LETTERS[:4], device=body.device)
    for _ in range(20):
        sync()
        marks = [time.perf_counter()]
        f = forest()
        marks.append(time.perf_counter())
        states, blocks = body._allocate(f)
        marks.append(time.perf_counter())
        plan = body._plan(f, states, blocks)
        marks.append(time.perf_counter())
        bucket, _ = body._bucket(f.num_tokens, len(f.segments), plan.pieces.shape[2], plan.levels)
        marks.append(time.perf_counter())
        body._load(bucket, plan)
        marks.append(time.perf_counter())
        assert bucket.graph is not None and bucket.logits is not None
        bucket.graph.replay()
        marks.append(time.perf_counter())
        logits = bucket.logits[:reads].clone()
        marks.append(time.perf_counter())
        sync()
        marks.append(time.perf_counter())
        chunks = -(-logits.shape[1] // CHUNK)
        parts = torch.empty(reads, chunks, FIELDS, dtype=torch.float64, device=body.device)
        letters = torch.empty(reads, len(LETTERS[:4]), device=body.device)
        marks.append(time.perf_counter())
        for r in range(reads):
            vocab_partials(logits[r], out=parts[r])
        marks.append(time.perf_counter())
        for r in range(reads):
            torch.index_select(logits[r], 0, index, out=letters[r])
        marks.append(time.perf_counter())
        parts_host, letters_host = parts.cpu(), letters.cpu()
        marks.append(time.perf_counter())
        for r in range(reads):
            readout.fold_vocab_mass(parts_host[r].tolist())
            letters_host[r].tolist()
        marks.append(time.perf_counter())
        steps = [b - a for a, b in zip(marks, marks[1:], strict=False)]
        del steps[8]  # the buffers' allocation (between gpu_wait and the launches)
        for name, dt in zip(names, steps, strict=False):
            times[name].append(dt)
        sync()
        t0 = time.perf_counter()
        vocab_partials(logits[0], out=parts[0])
        t1 = time.perf_counter()
        vocab_partials(logits[0], out=parts[0])
        t2 = time.perf_counter()
        times["launch_idle"].append(t1 - t0)
        times["launch_behind_kernel"].append(t2 - t1)
        body._load(bucket, plan)
        bucket.graph.replay()
        t0 = time.perf_counter()
        vocab_partials(logits[0], out=parts[0])
        times["launch_behind_graph"].append(time.perf_counter() - t0)
        sync()
        t0 = time.perf_counter()
        sum(i * i for i in range(10_000))  # the host's Python speed, to compare machines by
        times["python_loop"].append(time.perf_counter() - t0)
    return {n: round(1e6 * statistics.median(v), 1) for n, v in times.items()}


def agreement(bench: Bench, evidence_tokens: int, questions: int, question_tokens: int = 36) -> dict:
    """How far the bench's body (opt-in precision settings) lands from the exact body on one
    request with no cached parent: the largest logit difference relative to its row's largest
    logit, the largest change of a letter probability, and whether every answer is the same."""
    assert bench.body is not None
    segs = [Segment(bench.tokens(evidence_tokens), None)]
    segs += [Segment(bench.tokens(question_tokens), 0, read=True) for _ in range(questions)]
    forest = build_forest(segs)
    got = bench.body.run(forest).logits.float()
    want = ForestBody(bench.weights, graphs=False).run(forest).logits.float()
    rel = ((got - want).abs().amax(-1) / want.abs().amax(-1)).max().item()
    probs = [
        (read_letters(got[r], LETTERS[:4], 1.0), read_letters(want[r], LETTERS[:4], 1.0))
        for r in range(questions)
    ]
    pairs = [zip(a.probabilities, b.probabilities, strict=True) for a, b in probs]
    prob_diff = max(abs(x - y) for pair in pairs for x, y in pair)
    same = all(a.top == b.top for a, b in probs)
    return {"max_rel_logit_diff": rel, "max_letter_prob_diff": prob_diff, "same_answers": same}


def last_layer_agreement(
    bench: Bench, evidence_tokens: int, questions: int, question_tokens: int = 36
) -> dict:
    """The bench's body (last layer at the read rows) against an eager twin running the full
    last layer (`last_layer="full"`, the same settings) on one request under the bench's root:
    whether every state the pass writes (K/V, DeltaNet states, conv tails) has the same bits
    (it must), whether the read logits do (they do where the read row's attention is the 16-row
    forest kernel's operations in the same layouts: unsplit, a short segment), the largest logit
    difference relative to its row's largest logit, and whether the answers are the same."""
    body = bench.body
    assert body is not None and body.reads_only_last
    segs = [Segment(bench.tokens(evidence_tokens), bench.root)]
    segs += [Segment(bench.tokens(question_tokens), 0, read=True) for _ in range(questions)]
    forest = build_forest(segs)
    got = body.run(forest)
    twin = ForestBody(
        bench.weights, graphs=False, gdn_chunk=body.gdn_chunk, gdn_dots=body.gdn_dots,
        attention_dots=body.attention_dots, gdn_prep=body.gdn_prep, last_layer="full",
    )  # fmt: skip
    want = twin.run(forest)
    states = all(
        torch.equal(mine[layer], theirs[layer])
        for a, b in zip(got.states, want.states, strict=True)
        for mine, theirs in (
            (a.keys, b.keys),
            (a.values, b.values),
            (a.recurrent, b.recurrent),
            (a.conv, b.conv),
        )
        for layer in theirs
    )
    g, w = got.logits.float(), want.logits.float()
    rel = ((g - w).abs().amax(-1) / w.abs().amax(-1)).max().item()
    same = all(
        read_letters(g[r], LETTERS[:4], 1.0).top == read_letters(w[r], LETTERS[:4], 1.0).top
        for r in range(questions)
    )
    return {
        "states_same_bits": states,
        "logits_same_bits": torch.equal(g, w),
        "max_rel_logit_diff": rel,
        "same_answers": same,
    }


def serial(fn, n: int = 25, warmup: int = 5) -> dict[str, float]:
    """Mean, p50 and p99 of n - warmup timed calls. With 20 samples p99 interpolates between
    the two slowest (inclusive quantiles): the tail a user sees, not a fitted one."""
    return latency_stats([fn() for _ in range(n)][warmup:])


def latency_stats(seconds: list[float]) -> dict[str, float]:
    ms = [1e3 * t for t in seconds]
    p99 = statistics.quantiles(ms, n=100, method="inclusive")[98] if len(ms) > 1 else ms[0]
    return {"mean_ms": statistics.fmean(ms), "p50_ms": statistics.median(ms), "p99_ms": p99, "n": len(ms)}


def peer_model(config: ModelConfig, device: str):  # -> transformers.Qwen3_5ForCausalLM
    """HF transformers' Qwen3.5 decoder at the bench's shape, bf16, random weights (what a user
    runs today; built in bf16 directly: an fp32 27B build would not fit beside our weights)."""
    from transformers import Qwen3_5ForCausalLM

    from engine.testing.hf import to_hf_config

    hf = to_hf_config(config)
    hf._attn_implementation = "sdpa"
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen3_5ForCausalLM(hf)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def run_peer(
    config: ModelConfig, device: str, record: Callable[[str, object], None], *, skip_long: bool
) -> None:
    """Workloads (a)-(c) through the peer, timed like ours (25 serial calls, 5 discarded; (c) 10/2)."""
    import importlib.util

    model = peer_model(config, device)
    record("fla_importable", importlib.util.find_spec("fla") is not None)
    record("attention", model.config._attn_implementation)
    g = torch.Generator().manual_seed(2)
    prompt = 27 + 220 + 36  # the system root, the evidence and one question, as in ours

    def forward(batch: int, tokens: int) -> float:
        ids = torch.randint(0, VOCAB - 512, (batch, tokens), generator=g).to(device)
        mask = torch.ones_like(ids)
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=1, use_cache=False).logits
            for row in range(batch):
                read_letters(logits[row, -1].float(), LETTERS[:4], 1.0)
        sync()
        return time.perf_counter() - t0

    record("a_one_question_256", serial(lambda: forward(1, prompt)))
    record("b_three_questions_256", serial(lambda: forward(3, prompt)))
    readme_prompt = 27 + README_EVIDENCE_TOKENS + max(README_QUESTION_TOKENS)  # padded to the longest
    record(README_B, serial(lambda: forward(len(README_QUESTION_TOKENS), readme_prompt)))
    if not skip_long:
        record("c_one_question_8192", serial(lambda: forward(1, 27 + 8156 + 36), n=10, warmup=2))


def ratios_to_peer(ours: dict, peer: dict) -> dict[str, float]:
    """Peer mean latency / ours, per serial workload both ran (> 1: we are faster)."""
    return {
        key: peer[key]["mean_ms"] / ours[key]["mean_ms"]
        for key in ("a_one_question_256", "b_three_questions_256", README_B, "c_one_question_8192")
        if isinstance(ours.get(key), dict) and isinstance(peer.get(key), dict)
    }


def fp32_weights(weights: Weights) -> Weights:
    """The same model with every int8 linear dequantized to fp32 (`qweight * w_scale`): the
    fp32 reference path's weights, derived from the one build rather than built again."""

    def deq(w: object) -> object:
        if isinstance(w, QuantLinear):
            if w.smooth is not None:
                raise ValueError("the bench's linears carry no SmoothQuant vector")
            return w.qweight.float() * w.w_scale.float()[:, None]
        return w

    layers = [{k: deq(v) for k, v in layer.items()} for layer in weights.layers]
    return Weights(
        config=weights.config,
        token_embd=weights.token_embd,
        output_norm=weights.output_norm,
        output=deq(weights.output),
        layers=layers,
    )


TC64INV = {"gdn_chunk": 64, "gdn_dots": "bf16", "attention_dots": "bf16", "gdn_prep": "invert"}


def _tc64inv(**change: object) -> dict:
    """The CUDA default's body settings (`tc64inv`) with `change` on top: one variant's A/B."""
    return TC64INV | change


# the CUDA default with the long tier's own causal blocks in CUTLASS's Hopper FMHA kernel and the
# prep's bf16 queries, which the kernel then reads in place (padded rows, no copy)
FMHA_QBF16 = _tc64inv(
    set={
        "engine.kernels.forest_attention.FMHA_LONG_TIER": True,
        "engine.kernels.forest_attention.QUERIES_BF16": True,
    }
)

NO_FMHA = _tc64inv(
    set={
        "engine.kernels.forest_attention.FMHA_LONG_TIER": False,
        "engine.kernels.forest_attention.QUERIES_BF16": False,
    }
)

# --accuracy: the settings measured against the fp32 path (the exact body first: the int8 error
# every setting starts from)
ACCURACY_SETTINGS: dict[str, dict] = {
    "body": {},
    "attn-bf16": {"attention_dots": "bf16"},
    "attn-tf32": {"attention_dots": "tf32"},
    "chunk32": {"gdn_chunk": 32},
    "chunk32-tf32": {"gdn_chunk": 32, "gdn_dots": "tf32"},
    "tc": {"gdn_chunk": 32, "gdn_dots": "tf32", "attention_dots": "bf16"},
    "chunk64-bf16": {"gdn_chunk": 64, "gdn_dots": "bf16"},
    "tc64": {"gdn_chunk": 64, "gdn_dots": "bf16", "attention_dots": "bf16"},
    "tc64inv": TC64INV,
    # the CUDA default without the SwiGLU-fused gate+up GEMM (`int8_gemm.SWIGLU_TABLE` all None
    # for the variant): the same bits, so only the time moves
    "tc64inv-unfused": _tc64inv(swiglu=False),
    # the long tier's own blocks in CUTLASS's FMHA kernel, with bf16 queries (other bits in
    # segments of at least the tier's length: the accuracy-long forests reach it)
    "tc64inv-fmhaqbf16": FMHA_QBF16,
    "tc64inv-nofmha": NO_FMHA,
}
MARGIN = 0.1  # an fp32 read-out whose top two letters are closer than this has no answer to keep


def compare_readouts(got: list[list[float]], want: list[list[float]], margin: float = MARGIN) -> dict:
    """Letter probabilities of one setting (`got`) against the fp32 path's (`want`), read-out by
    read-out: how many fp32 read-outs are decisive (top-two margin >= `margin`), on how many of
    those the argmax agrees, and the largest and mean |delta p| over every letter."""
    decisive = agree = 0
    deltas: list[float] = []
    for g, w in zip(got, want, strict=True):
        top2 = sorted(w, reverse=True)[:2]
        if top2[0] - top2[1] >= margin:
            decisive += 1
            agree += int(g.index(max(g)) == w.index(max(w)))
        deltas += [abs(a - b) for a, b in zip(g, w, strict=True)]
    return {
        "readouts": len(want),
        "decisive": decisive,
        "argmax_agree": agree,
        "agreement": agree / decisive if decisive else None,
        "max_abs_dp": max(deltas),
        "mean_abs_dp": statistics.fmean(deltas),
    }


def accuracy_forests(g: torch.Generator, requests: int, long_requests: int, long_tokens: int) -> list[Forest]:
    """(b)-shaped forests (220 evidence tokens, 3 questions) and a few long one-question ones,
    each from no parent (no root state to share between the two paths)."""

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(0, VOCAB - 512, (n,), generator=g).tolist())

    shapes = [(220, 3)] * requests + [(long_tokens, 1)] * long_requests
    return [
        build_forest([Segment(tokens(ev), None)] + [Segment(tokens(36), 0, read=True) for _ in range(q)])
        for ev, q in shapes
    ]


def letter_probabilities(logits: torch.Tensor) -> list[list[float]]:
    return [
        list(read_letters(logits[r].float(), LETTERS[:4], 1.0).probabilities) for r in range(logits.shape[0])
    ]


def run_accuracy(weights: Weights, args: argparse.Namespace, record: Callable[[str, object], None]) -> None:
    forests = accuracy_forests(
        torch.Generator().manual_seed(3),
        args.accuracy_requests,
        args.accuracy_long,
        args.accuracy_long_tokens,
    )
    reference = fp32_weights(weights)
    t0 = time.perf_counter()
    want = [p for f in forests for p in letter_probabilities(run_forest(reference, f).logits)]
    record("reference", "fp32 level executor, the same weights dequantized")
    record("reference_s", time.perf_counter() - t0)
    del reference
    names = args.accuracy_settings.split(",") if args.accuracy_settings else list(ACCURACY_SETTINGS)
    for name in names:
        with applied(ACCURACY_SETTINGS[name]) as settings:
            body = ForestBody(weights, graphs=False, **(settings or {}))
            got = [p for f in forests for p in letter_probabilities(body.run(f).logits)]
        record(name, compare_readouts(got, want))
        del body


# --variants: executors run one after another in one process on the same weights (a 27B
# build is ~30 GB; rebuilding it per executor costs device time). name -> body settings.
VARIANTS: dict[str, dict | None] = {
    "body": {},
    "levels": None,  # the level-by-level executor (engine.run.executor)
    "eager": {"graphs": False},
    "chunk32": {"gdn_chunk": 32},
    "chunk16": {"gdn_chunk": 16},
    "chunk32-tf32": {"gdn_chunk": 32, "gdn_dots": "tf32"},
    "attn-bf16": {"attention_dots": "bf16"},
    "attn-tf32": {"attention_dots": "tf32"},
    "tc": {"gdn_chunk": 32, "gdn_dots": "tf32", "attention_dots": "bf16"},
    "chunk64-bf16": {"gdn_chunk": 64, "gdn_dots": "bf16"},
    "tc64": {"gdn_chunk": 64, "gdn_dots": "bf16", "attention_dots": "bf16"},
    "tc64inv": TC64INV,
    # the CUDA default without the SwiGLU-fused gate+up GEMM (`int8_gemm.SWIGLU_TABLE` all None
    # for the variant): the same bits, so only the time moves
    "tc64inv-unfused": _tc64inv(swiglu=False),
    # the CUDA default with every GEMM on the Triton tiles (`cutlass_gemm.TABLE` all None for the
    # variant; where the CUTLASS library is not built, the same as tc64inv): the same bits
    "tc64inv-triton": _tc64inv(cutlass=False),
    # the CUDA default with the former full last layer (every row through the last layer's query,
    # attention, output projection and MLP; `ForestBody(last_layer="full")`): the same states
    "tc64inv-fulllast": _tc64inv(last_layer="full"),
    # the CUDA default with the MLP's gate+up as CUTLASS's one-GEMM SwiGLU at every M CUTLASS
    # serves, or as the stacked GEMM and `swiglu_quantize` there (`cutlass_gemm.SWIGLU_MIN_ROWS`)
    "tc64inv-cutlassswiglu": _tc64inv(set={"engine.kernels.cutlass_gemm.SWIGLU_MIN_ROWS": 0}),
    "tc64inv-unfusedmlp": _tc64inv(set={"engine.kernels.cutlass_gemm.SWIGLU_MIN_ROWS": 1 << 62}),
    # the CUDA default with the 128x128 CUTLASS tile at every M it serves, never the narrower
    # tiles by waves (`cutlass_gemm.NARROW_MAX_ROWS` 0 for the variant): the same bits
    "tc64inv-squaretiles": _tc64inv(set={"engine.kernels.cutlass_gemm.NARROW_MAX_ROWS": 0}),
    # the CUDA default with session 14's row kernels: the norm's blocks of up to 4,096 values and
    # the gated norm on 8 warps (`quant.NORM_BLOCKING`, `decode_quant.GATED_WARPS`; the norm's
    # sum in its former order, so other bits)
    "tc64inv-rows14": _tc64inv(
        set={
            "engine.kernels.quant.NORM_BLOCKING": (4096, 8),
            "engine.kernels.decode_quant.GATED_WARPS": 8,
        },
    ),
    # the CUDA default with the 1x2-clustered CUTLASS tile for every linear above 2,048 rows,
    # never the swizzled 128x128 tile for the narrow outputs (`cutlass_gemm.SWIZZLED_MAX_COLUMNS`
    # 0 for the variant): the same bits
    "tc64inv-noswizzle": _tc64inv(set={"engine.kernels.cutlass_gemm.SWIZZLED_MAX_COLUMNS": 0}),
    # ... and the other way round: the swizzled 128x128 tile for every linear above 2,048 rows,
    # the wide in-projections too (`SWIZZLED_MAX_COLUMNS` past any width): the same bits. Why: in
    # an H100's (c) profile (session 25) the clustered in-projections seemed to run at ~1,030
    # TOP/s, the swizzled MLP up projection of the same K and a similar width at ~1,315. Lost on
    # the next H100 (one process, 02747a6): (c) 476.6 / 480.0 ms against 475.4 / 475.6; alone
    # (bench_cutlass.py --m 8192) the cluster is the faster for GDN in, 1,069 against 1,253 us
    "tc64inv-allswizzled": _tc64inv(set={"engine.kernels.cutlass_gemm.SWIZZLED_MAX_COLUMNS": 1 << 30}),
    # the CUDA default with the one-GEMM SwiGLU on the table's clustered tile above 2,048 rows, not
    # the swizzled one (`cutlass_gemm.SWIGLU_SWIZZLE` off): the same bits. Session 26 (H100, over
    # an interleaved copy): (c) 478.9 ms clustered against 467.5 swizzled
    "tc64inv-swiglucluster": _tc64inv(set={"engine.kernels.cutlass_gemm.SWIGLU_SWIZZLE": False}),
    # the CUDA default with the read-outs' "block" form (`readout.DEVICE_READ`: a pass's rows'
    # partials in one launch, the copy back into pinned memory): the same values
    "tc64inv-blockreads": _tc64inv(set={"engine.decide.readout.DEVICE_READ": "block"}),
    # the CUDA default with the read-outs' numbers made after the pass, not in its graph
    # (`body.READS_IN_PASS` off: the partials, letter gathers and copy back launched by the
    # read-out, as before session 20): the same values
    "tc64inv-hostreads": _tc64inv(set={"engine.run.body.READS_IN_PASS": False}),
    # the CUDA default with the attention output allocated uninitialized and only its dead rows
    # zeroed, not zero-filled whole (`forest_attention.ZERO_DEAD_ROWS_ONLY`): the same bits
    "tc64inv-attnzerodead": _tc64inv(set={"engine.kernels.forest_attention.ZERO_DEAD_ROWS_ONLY": True}),
    # the CUDA default with the GDN output gate's row held as tiles of 16 heads, all of o and z
    # loaded before the sums (`decode_quant.GATED_FORM` "blocks"): the padded form's bits; and as
    # tiles of 8 heads on 8 warps (4 values a lane, the resident norm's loads): other bits
    "tc64inv-gatedblocks": _tc64inv(set={"engine.kernels.decode_quant.GATED_FORM": "blocks"}),
    "tc64inv-gatedblocks8": _tc64inv(
        set={
            "engine.kernels.decode_quant.GATED_FORM": "blocks",
            "engine.kernels.decode_quant.GATED_BLOCK_HEADS": 8,
            "engine.kernels.decode_quant.GATED_BLOCK_WARPS": 8,
        }
    ),
    # the attention's queries stored in bf16 by the prep (every bf16-dot kernel rounds them so
    # anyway; no q16 staging): the same bits; the CUDA default since session 30, so the same
    # settings as tc64inv now (kept: older records name it)
    "tc64inv-qbf16": _tc64inv(set={"engine.kernels.forest_attention.QUERIES_BF16": True}),
    # the long tier's own causal blocks in CUTLASS's Hopper FMHA kernel, insisted on
    # (`forest_attention.FMHA_LONG_TIER` True: raises where the library lacks it; the default uses
    # it where built). Since session 30 bf16 queries are the default too, so tc64inv-fmha and
    # tc64inv-fmhaqbf16 run the same settings (kept: older records name them)
    "tc64inv-fmha": _tc64inv(set={"engine.kernels.forest_attention.FMHA_LONG_TIER": True}),
    # the CUDA default before session 30: the Triton long tier, fp32 queries from the prep
    "tc64inv-nofmha": NO_FMHA,
    "tc64inv-fmhaqbf16": FMHA_QBF16,
    # sessions 21 and 22's same-bits prefill candidates together (zeroed dead rows only, bf16
    # queries, the gated norm in tiles of 16 heads): what flipping all three would give
    "tc64inv-prefill22": _tc64inv(
        set={
            "engine.kernels.forest_attention.ZERO_DEAD_ROWS_ONLY": True,
            "engine.kernels.forest_attention.QUERIES_BF16": True,
            "engine.kernels.decode_quant.GATED_FORM": "blocks",
        }
    ),
    # the CUDA default with the SwiGLU quantizer's resident kernel as before session 21: its loads
    # unordered (ptxas issues the whole row's at once) and no register cap (`decode_quant`
    # RESIDENT_ORDERED, RESIDENT_AHEAD, RESIDENT_MAXNREG): the same bits
    "tc64inv-swigluunordered": _tc64inv(
        set={
            "engine.kernels.decode_quant.RESIDENT_ORDERED": False,
            "engine.kernels.decode_quant.RESIDENT_AHEAD": 4,
            "engine.kernels.decode_quant.RESIDENT_MAXNREG": None,
        }
    ),
    # the CUDA default with the attention's large-block tiers on a side stream, beside the split
    # and the 16-row kernel (`forest_attention.CONCURRENT_TIERS`): the same bits
    "tc64inv-concurrenttiers": _tc64inv(set={"engine.kernels.forest_attention.CONCURRENT_TIERS": True}),
    # the CUDA default with the GDN prep's invert form in three kernels (scores and A, the
    # inverse, w and u: `forest_gdn.TC_INVERT_SPLIT`, "invert_split"): the same bits
    "tc64inv-invertsplit": _tc64inv(set={"engine.kernels.forest_gdn.TC_INVERT_SPLIT": True}),
    # the CUDA default with the sampler's top-k numbers made inside the decode step's graph
    # (`decoder.TOP_K_IN_STEP`): the same tokens
    "tc64inv-steptopk": _tc64inv(
        set={"engine.run.decoder.TOP_K_IN_STEP": True, "engine.run.decoder.DRAW_IN_STEP": False}
    ),
    "tc64inv-steptopkkernel": _tc64inv(
        set={
            "engine.run.decoder.TOP_K_IN_STEP": True,
            "engine.run.decoder.DRAW_IN_STEP": False,
            "engine.kernels.top_k.TOP_K_FORM": "kernel",
        }
    ),
    # the thought draw on the host after each step (the default until session 32), and the draw
    # inside the step's graph without running ahead (`decoder.DRAW_IN_STEP`, `thoughts.RUN_AHEAD`,
    # both on by default since session 32): the same tokens
    "tc64inv-hostdraw": _tc64inv(
        set={"engine.run.decoder.DRAW_IN_STEP": False, "engine.thoughts.RUN_AHEAD": False}
    ),
    "tc64inv-stepdraw": _tc64inv(set={"engine.thoughts.RUN_AHEAD": False}),
    # the CUDA default with the sampler's top-k as two Triton kernels (`top_k.TOP_K_FORM`):
    # the same tokens
    "tc64inv-topkkernel": _tc64inv(set={"engine.kernels.top_k.TOP_K_FORM": "kernel"}),
    # the CUDA default without 64-row CUTLASS tiles as a narrow choice (`cutlass_gemm.HALF_ROW_TILES`,
    # on since session 17: buckets of 192 and 320 rows compute less padding): same bits
    "tc64inv-nohalfrowtiles": _tc64inv(set={"engine.kernels.cutlass_gemm.HALF_ROW_TILES": False}),
    # the CUDA default with the decoder's GDN step in 64-wide value blocks (`decode_gdn.BLOCK_V`;
    # 32 by default: 12,288 programs of 16 KB of state a layer at 64 rows) or on 8 warps (the conv
    # step's too): the 64-sequence step's GDN is 5.7 ms against its ~4.5 ms fp32-state floor.
    # Not the default's bits when compiled (the block shape sets the order of the sum over dk;
    # H200, session 17): taking one is a version change of the decode bits
    "tc64inv-gdnstepv64": _tc64inv(set={"engine.kernels.decode_gdn.BLOCK_V": 64}),
    # the CUDA default with Triton's GEMMs up to M 32 again, as before session 24 moved the 64x64
    # CUTLASS tile's bound from 33 to 17 rows (`cutlass_gemm.TABLE`): the same bits
    "tc64inv-tritonto32": _tc64inv(
        set={"engine.kernels.cutlass_gemm.TABLE": ((32, None), *(e for e in cutlass_gemm.TABLE if e[0] > 32))}
    ),
    "tc64inv-gdnstepw8": _tc64inv(set={"engine.kernels.decode_gdn.NUM_WARPS": 8}),
    # the CUDA default with the decoder's conv and GDN steps dispatched row first
    # (`decode_gdn.BLOCKS_FIRST` False, the order before session 33): the same bits
    "tc64inv-steprows": _tc64inv(set={"engine.kernels.decode_gdn.BLOCKS_FIRST": False}),
    # the CUDA default with the read rows' attention split over their keys as the decoder's is
    # (`decode_attention.SPLITS` programs per row and KV head; other fold order than unsplit)
    "tc64inv-reads16": _tc64inv(read_splits=16),
}


def variant_settings(args: argparse.Namespace) -> list[tuple[str, dict | None]]:
    """(label, settings) per run. A name may repeat: its later runs are labelled "name#2", ...
    Why: in one process the runs after the first were ~0.5 ms slower at (a) and (b) whatever they
    changed (session 23, H100), so a list that ends with the default again ("tc64inv,X,tc64inv")
    brackets that drift and a variant is read against both of the default's runs."""
    if args.variants:
        names = args.variants.split(",")
        unknown = [n for n in names if n not in VARIANTS]
        if unknown:
            raise SystemExit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
        runs: list[tuple[str, dict | None]] = []
        for i, n in enumerate(names):
            repeat = names[: i + 1].count(n)
            runs.append((n if repeat == 1 else f"{n}#{repeat}", VARIANTS[n]))
        return runs
    if args.levels:
        return [("levels", None)]
    settings = {"gdn_chunk": args.gdn_chunk, "gdn_dots": args.gdn_dots, "attention_dots": args.attention_dots}
    if args.body_eager:
        return [("eager", settings | {"graphs": False})]
    return [("body", settings)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="27B", choices=sorted(SHAPES))
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-long", action="store_true", help="skip the 8,192-token workload")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--profile", default=None, help="kernel profiles of (a), (b), (c): PATH.<a|b|c>.txt")
    ap.add_argument(
        "--decode-only",
        action="store_true",
        help="run workload (e) only, for every variant (otherwise only the first variant decodes)",
    )
    ap.add_argument("--decode-eager", action="store_true", help="decode without CUDA graphs (same kernels)")
    ap.add_argument("--levels", action="store_true", help="forests level by level (engine.run.executor)")
    ap.add_argument("--body-eager", action="store_true", help="one-pass forests without CUDA graphs")
    ap.add_argument("--gdn-chunk", type=int, default=0, help="body: GDN recurrence in chunks of N tokens")
    ap.add_argument("--gdn-dots", default="ieee", choices=GDN_DOTS, help="body: chunked GDN products")
    ap.add_argument(
        "--attention-dots", default="ieee", choices=ATTENTION_DOTS, help="body: attention dot precision"
    )
    ap.add_argument(
        "--variants",
        default=None,
        help=f"comma list run in one process on one weight build ({', '.join(VARIANTS)}); "
        "decode (e) runs with the first (with --decode-only, with each); JSON: {variant: result}",
    )
    ap.add_argument(
        "--decode-profile", default=None, help="profile decode steps at 1 and 64 sequences: PATH.N.txt"
    )
    ap.add_argument("--skip-decode", action="store_true", help="skip workload (e)")
    ap.add_argument(
        "--decode-sequences",
        default="1,64",
        help="workload (e): the concurrent sequences, comma list (each count keeps its prompts' "
        "pass and step graphs: 1,32,64 did not fit an 80 GB H100 at 27B, 1,64 and 32 alone did)",
    )
    ap.add_argument(
        "--skip-checks",
        action="store_true",
        help="skip each variant's accuracy and last-layer agreement passes (A/Bs of same-bit settings)",
    )
    ap.add_argument(
        "--wall-split", action="store_true", help="(a), (b): host tables / graph replay / run / decide"
    )
    ap.add_argument("--peer", action="store_true", help="then HF transformers bf16 on (a)-(c); JSON 'peer'")
    ap.add_argument("--accuracy", action="store_true", help="only: body settings vs the fp32 path")
    ap.add_argument("--accuracy-settings", default=None, help=f"comma list of {', '.join(ACCURACY_SETTINGS)}")
    ap.add_argument("--accuracy-requests", type=int, default=16, help="(b)-shaped forests (3 read-outs each)")
    ap.add_argument("--accuracy-long", type=int, default=2, help="long one-question forests")
    ap.add_argument("--accuracy-long-tokens", type=int, default=2048)
    ap.add_argument("--thinking", action="store_true", help="also run workload (f): thinking requests")
    ap.add_argument(
        "--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
        help="set a module constant for the whole run, e.g. engine.kernels.decode_quant.SPLIT_MAX_ROWS=0",
    )  # fmt: skip
    args = ap.parse_args()
    args.decode_sequences = decode_sequences(args.decode_sequences)  # a bad list stops here, before weights
    for assignment in args.set:
        set_constant(assignment)
    variants = variant_settings(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = shape_config(args.shape)
    t0 = time.perf_counter()
    weights = random_weights(config, device)
    sync()
    build_s = time.perf_counter() - t0
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    results: dict = {}

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results if args.variants or args.accuracy else results[variants[0][0]], f, indent=2)

    if args.accuracy:
        results["accuracy"] = acc = {"shape": args.shape, "device": gpu, "margin": MARGIN}

        def record_acc(key: str, value: object) -> None:
            acc[key] = value
            show(key, value)
            save()

        run_accuracy(weights, args, record_acc)
        return
    for k, (name, settings) in enumerate(variants):
        results[name] = result = {"shape": args.shape, "device": gpu, "build_s": build_s, "variant": name}
        first = k == 0
        for key, value in result.items():
            show(key, value)

        def record(key: str, value: object, result: dict = result) -> None:
            result[key] = value
            show(key, value)
            save()

        run_variant(
            args, weights, device, name, settings, record,
            decode=(first or args.decode_only) and not args.skip_decode, profile=first,
        )  # fmt: skip
        if device == "cuda":
            torch.cuda.empty_cache()  # the next variant's buckets and graphs start from free memory
    if args.peer:
        print("--- peer", flush=True)
        peer: dict = {"model": "transformers Qwen3_5ForCausalLM bf16", "shape": args.shape}
        # single-run JSON: the peer nests in the result; --variants: beside the variants
        (results if args.variants else results[variants[0][0]])["peer"] = peer

        def record_peer(key: str, value: object) -> None:
            peer[key] = value
            show(f"peer_{key}", value)
            save()

        run_peer(config, device, record_peer, skip_long=args.skip_long)
        for name, _ in variants:
            results[name]["vs_peer"] = ratios_to_peer(results[name], peer)
            show(f"{name}_vs_peer", results[name]["vs_peer"])
        save()


@contextlib.contextmanager
def applied(settings: dict | None) -> Iterator[dict | None]:
    """A variant's or accuracy setting's keys that are not `ForestBody` arguments, in force inside
    the block: `"swiglu": False` runs the unfused MLP path (every SWIGLU_TABLE entry None, so graphs
    are captured that way), `"cutlass": False` the Triton GEMM tiles only (every `cutlass_gemm.TABLE`
    entry None), `"set": {"MODULE.NAME": value}` those module constants (as `--set`). Yields the
    body's own settings (None stays None: the level executor); everything is put back after."""
    body = None if settings is None else dict(settings)
    fused = True if body is None else body.pop("swiglu", True)
    cutlass = True if body is None else body.pop("cutlass", True)
    constants = {} if body is None else body.pop("set", {})
    int8_gemm = importlib.import_module("engine.kernels.int8_gemm")  # the module, not the function
    table, cutlass_table = int8_gemm.SWIGLU_TABLE, cutlass_gemm.TABLE
    saved = {target: set_constant(f"{target}={value!r}") for target, value in constants.items()}
    if not fused:
        int8_gemm.SWIGLU_TABLE = tuple((m, None) for m, _ in table)
    if not cutlass:
        cutlass_gemm.TABLE = tuple((m, None) for m, _ in cutlass_table)
    try:
        yield body
    finally:
        int8_gemm.SWIGLU_TABLE, cutlass_gemm.TABLE = table, cutlass_table
        for target, value in saved.items():
            set_constant(f"{target}={value!r}")


def run_variant(
    args: argparse.Namespace,
    weights: Weights,
    device: str,
    name: str,
    settings: dict | None,
    record: Callable[[str, object], None],
    *,
    decode: bool,
    profile: bool,
) -> None:
    """One variant's workloads (with `profile`, the first variant's, also the kernel profiles),
    under its settings (`applied`: its graphs are captured with them)."""
    with applied(settings) as body:
        record("cutlass", (settings or {}).get("cutlass", True) and cutlass_gemm.library() is not None)
        record("cutlass_swiglu_min_rows", cutlass_gemm.SWIGLU_MIN_ROWS)
        record("cutlass_narrow_max_rows", cutlass_gemm.NARROW_MAX_ROWS)
        record("cutlass_swizzled_max_columns", cutlass_gemm.SWIZZLED_MAX_COLUMNS)
        _run_variant(args, weights, device, name, body, record, decode=decode, profile=profile)


def _run_variant(
    args: argparse.Namespace,
    weights: Weights,
    device: str,
    name: str,
    settings: dict | None,
    record: Callable[[str, object], None],
    *,
    decode: bool,
    profile: bool,
) -> None:
    g = torch.Generator().manual_seed(1)
    root_tokens = tuple(torch.randint(0, VOCAB - 512, (27,), generator=g).tolist())
    body = None if settings is None else ForestBody(weights, **settings)
    if body is not None:
        body.read_out_letters(LETTERS)  # as the engine's stages do: A..Z gathered in the pass
    run = body.run if body is not None else (lambda f: run_forest(weights, f))
    root = run(build_forest([Segment(root_tokens, None)])).states[0]
    bench = Bench(weights, root, device, g, graphs=False if args.decode_eager else None, body=body)
    print(f"--- {name}", flush=True)
    record("executor", "levels" if body is None else "body" + ("" if body.graphs else "-eager"))
    if body is not None:
        record("gdn_chunk", body.gdn_chunk)
        record("gdn_dots", body.gdn_dots)
        record("attention_dots", body.attention_dots)
        record("last_layer", body.last_layer)
        record("read_splits", body.read_splits)
    record("weights_gib", torch.cuda.memory_allocated() / 2**30 if device == "cuda" else 0.0)
    exact = body is None or (body.gdn_chunk, body.gdn_dots, body.attention_dots) == (0, "ieee", "ieee")
    if not exact and not args.decode_only and not args.skip_checks:  # accuracy, beside time
        record("accuracy_b_vs_exact", agreement(bench, 220, 3))
        if not args.skip_long:
            record("accuracy_c_vs_exact", agreement(bench, 8156, 1))
    if body is not None and body.reads_only_last and not args.decode_only and not args.skip_checks:
        # the last layer at the read rows against the full one: states, logits, answers
        record("lastlayer_b_vs_full", last_layer_agreement(bench, 220, 3))
        if not args.skip_long:
            record("lastlayer_c_vs_full", last_layer_agreement(bench, 8156, 1))
    if not args.decode_only:
        run_workloads(bench, record, skip_long=args.skip_long)
        if args.profile and profile:
            profile_prefill(bench, args.profile, skip_long=args.skip_long)
        if args.wall_split and body is not None and body.graphs:
            # the host forms on the same body and graphs: the default ("packed" tables, batched
            # read-outs) and, as "_lists", the session-10 host path (`HOST_TABLES`, `DEVICE_READS`)
            reads_now = readout.DEVICE_READ  # the default's, or what the variant set
            for suffix, (tables, reads) in {
                "": ("packed", reads_now),
                "_lists": ("lists", "per_row"),
            }.items():
                body.host_tables, readout.DEVICE_READ = tables, reads
                try:
                    record(f"a_wall_split{suffix}", wall_split(bench, 220, 1))
                    record(f"b_wall_split{suffix}", wall_split(bench, 220, 3))
                finally:
                    body.host_tables, readout.DEVICE_READ = HOST_TABLES[0], reads_now
    if decode:
        for n in args.decode_sequences:
            bench.decode(n, 4 if n == 1 else 2)  # warm-up: compiles the kernels, captures the bucket's graph
            record(f"e_decode_{n}_tok_per_s", bench.decode(n, args.decode_steps))
        if args.decode_profile:
            for n in (1, 64):
                profile_decode(bench, n, f"{args.decode_profile}.{args.shape}")
    if decode and args.thinking:
        run_thinking(bench, record)
    record("peak_gib", torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


if __name__ == "__main__":
    main()
