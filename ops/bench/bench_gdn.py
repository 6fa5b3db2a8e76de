"""Time the forest Gated DeltaNet paths per layer at the 27B GDN shape (CUDA only).

    PYTHONPATH=. python3 ops/bench/bench_gdn.py [--out gdn.json] [--reps 50]

One GDN layer (16 key heads x 128, 48 value heads x 128) over three forests read from device
tables: T=256 (one segment), (b) 256 + 3 x 40 (evidence then three questions from its final
state: two levels), T=8,192 (one segment). Paths: token by token; "tc64 bf16", the chunk-64
tensor-core prep + fused walk (the first version); the split form - prep, a walk that makes
only the state's products, then every chunk's outputs in one parallel launch - at bf16 with
BV value columns, w warps and s pipeline stages per walk program ("split bf16" is the
default, BV 32 w4 s2), and at tf32. The chunk-64 prep comes in two forms (`prep_form`): the
shipped "blocks" (16-row block substitution) and "invert" (whole-chunk products and a blocked
tf32 inverse): the rows named "inv" run the latter ("inv w8": on 8 warps). Each is captured in
one CUDA graph per forest and replayed: median over `--reps` timed replays after warm-up, of
CUDA event time per replay = ms per layer. "split bf16" and "split bf16 inv" are followed by
their parts, each in a graph of its own: the prep, the levels' walks, the outputs launch (their
sum exceeds the whole by the launch overheads). Closing table: the two prep forms side by side
(bf16 split walk: prep alone, whole layer, maxdiff, state).
Then the decayed q and k (`TC_DECAYED_FORMS`, the "invert" prep): "split bf16 inv" is the
layer as it ran before (the prep stores q exp(gam) and k exp(gam_last - gam), the body zeroes
`o` first: the memset is timed in the layer), "inv rc" remakes both where they are read and
writes the padding rows' zeros in the outputs launch instead of a memset (the body's default
now), "inv rcq" remakes only q exp(gam) (the walk reads k's stored). The second closing table
puts them side by side: layer and parts in ms, and whether outputs and final states are the
same bits as the old row's (they should be: the prep is one build for every form). With
`--old-module FILE` (engine/kernels/forest_gdn.py as it was before, e.g. `git show
5d4329e:engine/kernels/forest_gdn.py > FILE`), "inv old build" runs that file's kernels the old
way (stored, memset) in the same process, and the table also says whether each row has its bits.
`maxdiff` is the largest |o - o_token| over the live rows and `state` the largest difference
of the final states, both against the token-by-token kernel (the exact path); `s` is the
seconds since the start when the row was printed (compiles included), so a run cut short
shows where its time went. If `import fla` works, fla-core's `chunk_gated_delta_rule` (bf16)
is timed the same way at the same lengths, after all our rows, for a side-by-side (its (b)
runs four independent sequences: fla has no forest; eagerly if its graph capture fails).
Then the invert prep in three kernels ("invert_split": scores and A, the inverse, w and u;
`forest_gdn._invert_split`): "split bf16 inv3" runs it where "split bf16 inv" runs the fused
kernel (stored decays, the memset), "inv3 wu8" with its w, u kernel on 8 warps
(`TC_INVERT_SPLIT_WARPS`, set for that row only). The third closing table puts them beside the
fused row: prep alone and the layer in ms, whether every tensor of the prep is the fused
prep's bits (made once more outside the timing, all rows live here), and whether the layer's
outputs and final states are the fused row's bits. Only those rows (and token, the reference):

    PYTHONPATH=. python3 ops/bench/bench_gdn.py --no-fla \
        --paths "split bf16 inv,split bf16 inv3,split bf16 inv3 wu8"
"""

# Every closure below is timed inside the loop iteration that made it, so late binding is moot.
# ruff: noqa: B023

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from engine.kernels import forest_gdn as forest_gdn_module
from engine.kernels.forest_gdn import TC_CHUNK, forest_gdn, forest_gdn_outputs, forest_gdn_prep
from engine.kernels.forest_tables import (
    BLOCK_M,
    ROW_FIELDS,
    ROW_LIVE,
    ROW_LOCAL,
    ROW_SEG,
    SEG_FIELDS,
    SEG_HAS_STATE_IN,
    SEG_LENGTH,
    SEG_LEVEL,
    SEG_LIVE,
    SEG_STATE_IN,
    SEG_STATE_OUT,
    SEG_TOK_LO,
)

HQK, HV, DK, DV = 16, 48, 128, 128
STATE = HV * DK * DV
FORESTS = {
    "T=256": [(256, None)],
    "(b) 256+3x40": [(256, None), (40, 0), (40, 0), (40, 0)],
    "T=8192": [(8192, None)],
}
# also timed launch kind by launch kind (prep, the levels' walks, outputs)
BREAKDOWN = (
    "split bf16",
    "split bf16 inv",
    "split bf16 inv rc",
    "split bf16 inv rcq",
    "split bf16 inv3",
    "split bf16 inv3 wu8",
)
OLD, NEW = "blocks", "invert"  # the prep forms compared in the closing table
DECAYED = ("split bf16 inv", "split bf16 inv rc", "split bf16 inv rcq")  # old, new, half: second table
OLD_BUILD = "inv old build"  # --old-module: the kernels before TC_DECAYED_FORMS, the old way
SPLIT = ("split bf16 inv3", "split bf16 inv3 wu8")  # "invert_split", against DECAYED[0]: third table
# path: (chunk, dots, prep options); "split bf16" is what forest_gdn_prep(chunk=64) did by default
# when the "invert" form was written (the prep form and the decayed form are named, so the rows
# keep their meaning). "memset": the layer zeroes `o` first (the body before the outputs launch
# wrote the padding rows); otherwise it passes the row table to the outputs launch.
STORED = dict(decayed="stored", memset=True)
PATHS = {
    "token": (0, "ieee", dict(memset=True)),
    "tc64 bf16": (TC_CHUNK, "bf16", dict(STORED, walk="fused", prep_form=OLD)),
    "split bf16": (TC_CHUNK, "bf16", dict(STORED, prep_form=OLD)),
    OLD_BUILD: (
        TC_CHUNK,
        "bf16",
        dict(prep_form=NEW, memset=True),
    ),  # only with --old-module; first: the rows after compare with it
    "split bf16 inv": (TC_CHUNK, "bf16", dict(STORED, prep_form=NEW)),
    "split bf16 inv rc": (TC_CHUNK, "bf16", dict(prep_form=NEW, decayed="recomputed")),
    "split bf16 inv rcq": (TC_CHUNK, "bf16", dict(prep_form=NEW, decayed="recomputed_q")),
    "split bf16 inv w8": (TC_CHUNK, "bf16", dict(STORED, prep_form=NEW, prep_warps=8)),
    "split BV64 w4": (TC_CHUNK, "bf16", dict(STORED, walk_bv=64, walk_warps=4)),
    "split BV64 w8": (TC_CHUNK, "bf16", dict(STORED, walk_bv=64, walk_warps=8)),
    "split BV16 w4": (TC_CHUNK, "bf16", dict(STORED, walk_bv=16, walk_warps=4)),
    "split BV32 s3": (TC_CHUNK, "bf16", dict(STORED, walk_stages=3)),
    "split tf32": (TC_CHUNK, "tf32", dict(STORED, prep_form=OLD)),
    "split tf32 inv": (TC_CHUNK, "tf32", dict(STORED, prep_form=NEW)),
    # the invert prep in three kernels ("split_warps": TC_INVERT_SPLIT_WARPS for the row)
    "split bf16 inv3": (TC_CHUNK, "bf16", dict(STORED, prep_form="invert_split")),
    "split bf16 inv3 wu8": (TC_CHUNK, "bf16", dict(STORED, prep_form="invert_split", split_warps=(4, 4, 8))),
}
PREP_TENSORS = ("w", "u", "qg", "kd", "scores", "gam", "q_norm", "k_norm", "gam_last")


def split_warps(fn: Callable[[], object], warps: tuple[int, int, int] | None) -> Callable[[], None]:
    """fn with `forest_gdn.TC_INVERT_SPLIT_WARPS` set to `warps` while it runs (None: as it is);
    the launches read it when made, so a graph captured inside keeps those warps."""
    if warps is None:
        return fn

    def run() -> None:
        before = forest_gdn_module.TC_INVERT_SPLIT_WARPS
        forest_gdn_module.TC_INVERT_SPLIT_WARPS = warps
        try:
            fn()
        finally:
            forest_gdn_module.TC_INVERT_SPLIT_WARPS = before

    return run


def prep_bits(got, want, chunk_rows: list[int]) -> list[str]:
    """The prep tensors whose bits differ between two chunk-64 preps of one forest with every
    row live (the chunk numbers only at the chunks' first rows: nothing else is written)."""
    differ = [
        name
        for name in PREP_TENSORS
        if not torch.equal(getattr(got, name).view(torch.uint8), getattr(want, name).view(torch.uint8))
    ]
    if not torch.equal(got.chunk_no[chunk_rows], want.chunk_no[chunk_rows]):
        differ.append("chunk_no")
    return differ


def forest(spec: list[tuple[int, int | None]], dev: torch.device):
    """Tables of segments (length, parent slot or None) packed in order, each with its own state block."""
    segs = torch.zeros(len(spec), SEG_FIELDS, dtype=torch.int64)
    qblocks, lo = [], 0
    for s, (n, parent) in enumerate(spec):
        rec = segs[s]
        rec[SEG_TOK_LO], rec[SEG_LENGTH], rec[SEG_LIVE], rec[SEG_STATE_OUT] = lo, n, 1, s * STATE
        if parent is not None:
            rec[SEG_LEVEL], rec[SEG_STATE_IN], rec[SEG_HAS_STATE_IN] = 1, parent * STATE, 1
        qblocks += [[s, b, 1] for b in range(0, n, BLOCK_M)]
        lo += n
    rows = torch.zeros(lo, ROW_FIELDS, dtype=torch.int64)  # every row live (no padding here)
    rows[:, ROW_SEG] = torch.repeat_interleave(torch.arange(len(spec)), torch.tensor([n for n, _ in spec]))
    rows[:, ROW_LOCAL] = torch.cat([torch.arange(n) for n, _ in spec])
    rows[:, ROW_LIVE] = 1
    return (
        segs.to(dev),
        torch.tensor(qblocks, dtype=torch.int64, device=dev),
        lo,
        1 + any(p is not None for _, p in spec),
        rows.to(dev),
    )


def timed(fn: Callable[[], None], reps: int, graph: bool = True) -> float:
    """Median ms of one replay of fn captured in a CUDA graph (graph=False: of one eager call)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    for _ in range(5):
        run()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def save(path: str | None, results: list[dict]) -> None:
    """Rewrite the JSON after every row: a run cut short keeps what it measured."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


def table(results: list[dict]) -> None:
    """The two chunk-64 prep forms side by side (bf16 split walk): prep alone, the whole layer,
    and the accuracy of each against the token-by-token kernel."""
    got = {(r["forest"], r["path"]): r for r in results}
    old, new = BREAKDOWN[:2]
    print(
        f"\nprep forms (bf16 split walk): {OLD} ({old!r}) vs {NEW} ({new!r}); ms/layer, max |diff| vs token"
    )
    print(f"{'forest':<14} {'prep old':>9} {'prep new':>9} {'layer old':>9} {'layer new':>9} "
          f"{'maxdiff old':>11} {'maxdiff new':>11} {'state old':>10} {'state new':>10}")  # fmt: skip
    for name in FORESTS:
        a, b = got.get((name, old)), got.get((name, new))
        pa, pb = got.get((name, f"{old}: prep")), got.get((name, f"{new}: prep"))
        if not (a and b and pa and pb):
            continue
        print(
            f"{name:<14} {pa['ms']:>9.4f} {pb['ms']:>9.4f} {a['ms']:>9.4f} {b['ms']:>9.4f} "
            f"{a['maxdiff']:>11.2e} {b['maxdiff']:>11.2e} {a['state_diff']:>10.2e} {b['state_diff']:>10.2e}"
        )


def decayed_table(results: list[dict]) -> None:
    """The decayed forms side by side (invert prep, bf16 split walk): the old layer (stored, with
    the memset of o) against remaking both (rc) or only q exp(gam) (rcq), whole layer and parts,
    and whether each new row's outputs and final states are the old row's bits."""
    got = {(r["forest"], r["path"]): r for r in results}
    old, new, half = DECAYED
    rows_of = (OLD_BUILD, *DECAYED)
    print(f"\ndecayed q/k (invert prep, bf16 split walk): {old!r} (stored + memset of o) vs {new!r}")
    print(f"and {half!r} (q only); ms/layer; same bits: outputs and final states equal to {old!r}'s")
    cols = ("layer", "prep", "walks", "outputs")
    print(
        f"{'forest':<14} {'path':<20} "
        + " ".join(f"{c:>8}" for c in cols)
        + f" {'same bits':>10} {'as old build':>12}"
    )
    for name in FORESTS:
        for path in rows_of:
            row = got.get((name, path))
            if not row:
                continue
            parts = [row["ms"]] + [
                got.get((name, f"{path}: {p}"), {}).get("ms", float("nan")) for p in cols[1:]
            ]
            same = "-" if path in (old, OLD_BUILD) else str(row.get("same_bits_as_old", "?"))
            build = "-" if path == OLD_BUILD else str(row.get("same_bits_as_old_build", "-"))
            print(
                f"{name:<14} {path:<20} " + " ".join(f"{x:>8.4f}" for x in parts) + f" {same:>10} {build:>12}"
            )


def split_table(results: list[dict]) -> None:
    """The invert prep fused and in three kernels side by side (bf16 split walk, stored decays):
    prep alone and the layer in ms, and whether the prep's tensors and the layer's outputs and
    final states are the fused row's bits."""
    got = {(r["forest"], r["path"]): r for r in results}
    fused = DECAYED[0]
    print(f"\ninvert prep fused ({fused!r}) vs in three kernels; ms/layer; same bits as the fused row's")
    print(f"{'forest':<14} {'path':<20} {'prep':>8} {'layer':>8} {'prep bits':>10} {'layer bits':>10}")
    for name in FORESTS:
        for path in (fused, *SPLIT):
            row = got.get((name, path))
            if not row:
                continue
            prep = got.get((name, f"{path}: prep"), {}).get("ms", float("nan"))
            same_prep = "-" if path == fused else str(row.get("prep_bits_equal", "?"))
            same = "-" if path == fused else str(row.get("same_bits_as_old", "?"))
            print(f"{name:<14} {path:<20} {prep:>8.4f} {row['ms']:>8.4f} {same_prep:>10} {same:>10}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--paths", help="comma-separated path names to time (token always runs)")
    ap.add_argument("--no-fla", action="store_true", help="skip fla's side-by-side")
    ap.add_argument(
        "--old-module", help="a former engine/kernels/forest_gdn.py: its kernels run as OLD_BUILD"
    )
    args = ap.parse_args()
    paths = {k: v for k, v in PATHS.items() if k == "token" or not args.paths or k in args.paths.split(",")}
    builds = {"new": (forest_gdn_prep, forest_gdn, forest_gdn_outputs)}
    if args.old_module:  # a module of its own: its kernels are other functions, compiled apart
        spec = importlib.util.spec_from_file_location("forest_gdn_old", args.old_module)
        old_module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = old_module  # its dataclasses look their module up there
        spec.loader.exec_module(old_module)
        builds["old"] = (old_module.forest_gdn_prep, old_module.forest_gdn, old_module.forest_gdn_outputs)
    else:
        paths.pop(OLD_BUILD, None)
        print(f"no --old-module: {OLD_BUILD!r} skipped")
    t_start = time.perf_counter()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    heads = dict(num_k_heads=HQK, num_v_heads=HV, k_dim=DK, v_dim=DV)
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # optional side-by-side
        chunk_gated_delta_rule = None
        print(f"fla: not available ({type(e).__name__}: {e})")
    results, made = [], []
    old_bits: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}  # (forest, path) -> (o, states)
    print(f"{'forest':<14} {'path':<18} {'ms/layer':>9} {'maxdiff':>10} {'state':>10} {'s':>5}")
    for name, spec in FORESTS.items():
        segs, qblocks, t, levels, rows = forest(spec, dev)
        conv = torch.nn.functional.silu(torch.randn(t, 2 * HQK * DK + HV * DV, device=dev, generator=gen))
        b_raw = torch.randn(t, HV, device=dev, generator=gen)
        a_raw = torch.randn(t, HV, device=dev, generator=gen)
        ssm_a = -torch.rand(HV, device=dev, generator=gen) * 4 - 0.5
        dt = torch.randn(HV, device=dev, generator=gen) * 0.5
        base = torch.zeros(len(spec) * STATE, device=dev)
        live = [
            r
            for lo, (n, _) in zip(segs[:, SEG_TOK_LO].tolist(), spec, strict=True)
            for r in range(lo, lo + n)
        ]
        ref_o = ref_state = None
        for path, (chunk, dots, options) in paths.items():
            out = torch.zeros(t, HV, DV, device=dev)
            opts = {k: v for k, v in options.items() if k not in ("memset", "split_warps")}
            warps = options.get("split_warps")
            memset = bool(options.get("memset"))
            prep_fn, gdn_fn, outputs_fn = builds["old" if path == OLD_BUILD else "new"]
            rows_kw = {} if memset else dict(rows=rows)  # the old build's outputs take no rows

            def layer(chunk: int = chunk, dots: str = dots, out: torch.Tensor = out) -> None:
                if memset:  # the body's torch.zeros of o (the rows-table forms write every row)
                    out.zero_()
                prep = None
                if chunk:
                    prep = prep_fn(
                        conv, b_raw, a_raw, ssm_a, dt, segs, qblocks, **heads, chunk=chunk, dots=dots, **opts
                    )
                for level in range(levels):  # as the body: the split form's outputs after the last level
                    gdn_fn(
                        conv, b_raw, a_raw, ssm_a, dt, base, segs, level, 0, out, **heads,
                        chunk=chunk, dots=dots, prep=prep, outputs=False,
                    )  # fmt: skip
                outputs_fn(prep, segs, out, **rows_kw)

            ms = timed(split_warps(layer, warps), args.reps)
            o, state = out[live], base.clone()
            if ref_o is None:
                ref_o, ref_state = o, state
            diff = (o - ref_o).abs().max().item()
            sdiff = (state - ref_state).abs().max().item()
            el = time.perf_counter() - t_start
            print(f"{name:<14} {path:<18} {ms:>9.4f} {diff:>10.2e} {sdiff:>10.2e} {el:>5.0f}", flush=True)
            results.append(dict(forest=name, path=path, ms=ms, maxdiff=diff, state_diff=sdiff))
            if path in (DECAYED[0], OLD_BUILD):
                old_bits[name, path] = (out.clone(), state)
            for key, ref in (("same_bits_as_old", DECAYED[0]), ("same_bits_as_old_build", OLD_BUILD)):
                if path in (*DECAYED, *SPLIT, OLD_BUILD) and path != ref and (name, ref) in old_bits:
                    o_ref, s_ref = old_bits[name, ref]
                    results[-1][key] = torch.equal(out, o_ref) and torch.equal(state, s_ref)
            if path in SPLIT:  # every prep tensor against the fused kernel's, made once more untimed
                made_prep: list = []

                def make() -> None:
                    args_ = (conv, b_raw, a_raw, ssm_a, dt, segs, qblocks)
                    made_prep.append(prep_fn(*args_, **heads, chunk=chunk, dots=dots, **opts))

                split_warps(make, warps)()
                fused = prep_fn(
                    conv, b_raw, a_raw, ssm_a, dt, segs, qblocks, **heads, chunk=chunk, dots=dots,
                    **dict(opts, prep_form=NEW),
                )  # fmt: skip
                chunk_rows = [lo + c for lo, (n, _) in zip(segs[:, SEG_TOK_LO].tolist(), spec, strict=True)
                              for c in range(0, n, TC_CHUNK)]  # fmt: skip
                differ = prep_bits(made_prep[0], fused, chunk_rows)
                results[-1]["prep_bits_equal"] = not differ
                if differ:
                    results[-1]["prep_bits_differ"] = differ
                    print(f"{name:<14} {'  prep bits differ':<18} {', '.join(differ)}", flush=True)
                del made_prep, fused
            save(args.out, results)
            if path in BREAKDOWN or path == OLD_BUILD:  # where its time goes: each launch kind in a graph
                prep = prep_fn(
                    conv, b_raw, a_raw, ssm_a, dt, segs, qblocks, **heads, chunk=chunk, dots=dots, **opts
                )
                parts = {
                    "prep": lambda: prep_fn(
                        conv, b_raw, a_raw, ssm_a, dt, segs, qblocks, **heads, chunk=chunk, dots=dots, **opts
                    ),
                    "walks": lambda: [
                        gdn_fn(
                            conv,
                            b_raw,
                            a_raw,
                            ssm_a,
                            dt,
                            base,
                            segs,
                            level,
                            0,
                            out,
                            **heads,
                            chunk=chunk,
                            dots=dots,
                            prep=prep,
                            outputs=False,
                        )  # fmt: skip
                        for level in range(levels)
                    ],
                    "outputs": lambda: outputs_fn(prep, segs, out, **rows_kw),
                }
                for part, fn in parts.items():
                    ms = timed(split_warps(fn, warps), args.reps)
                    print(f"{name:<14} {'  ' + part:<18} {ms:>9.4f}", flush=True)
                    results.append(dict(forest=name, path=f"{path}: {part}", ms=ms))
        made.append((name, spec, t, levels, conv, b_raw, a_raw, ssm_a, dt, ref_o))
    table(results)
    decayed_table(results)
    split_table(results)
    # fla last, so a slow autotune of its kernels cannot cut our rows short
    for name, spec, t, levels, conv, b_raw, a_raw, ssm_a, dt, ref_o in made:
        if chunk_gated_delta_rule is None or args.no_fla:
            break
        group = HV // HQK
        q, k, v = conv.split([HQK * DK, HQK * DK, HV * DV], dim=-1)
        q = q.view(1, t, HQK, DK).repeat_interleave(group, dim=2).bfloat16()
        k = k.view(1, t, HQK, DK).repeat_interleave(group, dim=2).bfloat16()
        v = v.reshape(1, t, HV, DV).bfloat16()
        g = (ssm_a * torch.nn.functional.softplus(a_raw + dt)).view(1, t, HV)
        beta = torch.sigmoid(b_raw).view(1, t, HV).bfloat16()
        # one sequence: no cu_seqlens (fla then needs no host sync and fits in a graph)
        cu = None
        if len(spec) > 1:
            cu = torch.tensor([0, *torch.tensor([n for n, _ in spec]).cumsum(0).tolist()], device=dev)

        def fla_layer() -> None:
            chunk_gated_delta_rule(
                q, k, v, g, beta, scale=DK**-0.5, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                output_final_state=True,
            )  # fmt: skip

        try:
            label = "fla 0.6 bf16"
            try:
                ms = timed(fla_layer, args.reps)
            except Exception:  # varlen fla syncs with the host: no graph; time it eagerly
                torch.cuda.synchronize()
                label = "fla eager"
                ms = timed(fla_layer, args.reps, graph=False)
            o_fla, _ = chunk_gated_delta_rule(
                q, k, v, g, beta, scale=DK**-0.5, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                output_final_state=True,
            )  # fmt: skip
            diff = (o_fla[0].float() - ref_o).abs().max().item() if levels == 1 else float("nan")
            el = time.perf_counter() - t_start
            print(f"{name:<14} {label:<18} {ms:>9.4f} {diff:>10.2e} {'':>10} {el:>5.0f}", flush=True)
            results.append(dict(forest=name, path=label, ms=ms, maxdiff=diff))
            save(args.out, results)
        except Exception as e:
            print(f"{name:<14} fla failed: {type(e).__name__}: {str(e)[:200]}")


if __name__ == "__main__":
    main()
