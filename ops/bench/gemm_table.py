"""Turn a GEMM sweep's JSON (bench_kernels.py --gemm-only --out) into CONFIG_TABLE / SHAPE_TABLE.

    python3 ops/bench/gemm_table.py gemm_sweep.json [--margin 0.03] [--merge]

Prints Python source for engine/kernels/int8_gemm.py. The rule, so the table is reproducible:
- CONFIG_TABLE: per swept M, the one bit-exact config with the least decode-step-weighted time
  summed over every swept linear of every model (the sweep's `proposal.per_m`);
- SHAPE_TABLE: per weight shape (N, K), at each swept M, that shape's own best config where it
  beats the CONFIG_TABLE config at that M by more than `margin` (else the CONFIG_TABLE one, so
  timing noise does not scatter configs); a shape whose entries all equal CONFIG_TABLE is left out.
Each swept M is the largest M of its bucket: M in (previous swept M, this M] runs its config.
Consecutive buckets with the same config merge. Every config gives the same bits (the sweep
checked each against the reference), so the table is a choice of speed only.
`--merge` (a sweep of a few Ms, e.g. `--m 16,64 --models 27B`): the shipped tables, read from
engine/kernels/int8_gemm.py, with only the buckets that end at a swept M replaced by the rule
above; other Ms and unswept shapes keep their entries (`merged_tables`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

_CFG = re.compile(
    r"(\d+)x(\d+)x(\d+)/w(\d+)/s(\d+)(?:/g(\d+))?(?:/split(\d+)(\+pass)?)?(/tma)?(?:/e(\d+))?(/ws)?(/gemv)?"
    r"(?:/sk(\d+))?$"
)


def config_source(name: str) -> str:
    """`GemmConfig(...)` source for a config's str() (the sweep's JSON keys)."""
    m = _CFG.match(name)
    if m is None:
        raise ValueError(f"not a GemmConfig string: {name!r}")
    bm, bn, bk, w, s, g, split, unfused, tma, epi, ws, gemv, sk = m.groups()
    args = [bm, bn, bk, w, s]
    if g:
        args.append(f"group_m={g}")
    if split:
        args.append(f"split_k={split}")
    if unfused:
        args.append("split_fused=False")
    if tma:
        args.append("persistent=True")
    if epi:
        args.append(f"epilogue_split={epi}")
    if ws:
        args.append("warp_specialize=True")
    if gemv:
        args.append("gemv=True")
    if sk:
        args.append(f"stream_k={sk}")
    return f"GemmConfig({', '.join(args)})"


def merge(entries: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Buckets (max_m, config) with runs of one config merged into the run's last bucket; the
    last bucket is open-ended (1 << 62)."""
    out: list[tuple[int, str]] = []
    for m, cfg in entries:
        if out and out[-1][1] == cfg:
            out[-1] = (m, cfg)
        else:
            out.append((m, cfg))
    out[-1] = (1 << 62, out[-1][1])
    return out


Table = list[tuple[int, str]]


def swept(gemm: dict, margin: float) -> tuple[dict[int, str], dict[tuple[int, int], dict[int, str]]]:
    """The sweep's choice at each swept M, before bucketing: the per-M config, and per weight
    shape its own best where that beats the per-M config by more than `margin` (else the
    per-M config)."""
    rows = gemm["rows"]
    per_m = {int(m): c for m, c in gemm["proposal"]["per_m"].items()}
    shapes: dict[tuple[int, int], dict[int, str]] = {}
    for n, k in dict.fromkeys((r["n"], r["k"]) for r in rows):
        entries = shapes.setdefault((n, k), {})
        for m in sorted(per_m):
            rs = [r for r in rows if (r["n"], r["k"]) == (n, k) and r["m"] == m and r["candidates"]]
            base = per_m[m]
            if not rs or any(base not in r["candidates"] for r in rs):
                entries[m] = base
                continue
            # the shape's rows at this M (a shape used twice, e.g. two +res projections, sums)
            exact = set.intersection(*({c for c, v in r["candidates"].items() if v["bit_equal"]} for r in rs))
            t = {c: sum(r["candidates"][c]["ms"] for r in rs) for c in exact}
            best = min(t, key=t.get)
            entries[m] = best if t[best] < (1 - margin) * t[base] else base
    return per_m, shapes


def tables(gemm: dict, margin: float) -> tuple[Table, dict[tuple[int, int], Table]]:
    """(CONFIG_TABLE, SHAPE_TABLE) as (max_m, config string) lists, by the module's rule."""
    per_m, per_shape = swept(gemm, margin)
    common = merge(sorted(per_m.items()))
    shapes = {key: merge(sorted(e.items())) for key, e in per_shape.items()}
    return common, {key: t for key, t in shapes.items() if t != common}


def overlay(old: Table, new: dict[int, str]) -> Table:
    """`old` with the buckets that end at a swept M replaced: M in (the previous bound of old
    or new, swept M] runs the sweep's config, every other M what it ran before."""

    def old_at(m: int) -> str:
        return next((c for b, c in old if m <= b), old[-1][1])

    bounds = sorted({b for b, _ in old} | set(new))
    return merge([(b, new[b] if b in new else old_at(b)) for b in bounds])


def merged_tables(
    gemm: dict, margin: float, config_table: Table, shape_table: dict[tuple[int, int], Table]
) -> tuple[Table, dict[tuple[int, int], Table]]:
    """The shipped tables with only the swept M buckets replaced (a sweep of a few Ms, e.g.
    `--m 16,64 --models 27B`, leaves every other bucket and every unswept shape as it was). A
    swept shape not in the shape table starts from the shipped CONFIG_TABLE; a shape whose
    merged table equals the merged CONFIG_TABLE is left out."""
    per_m, per_shape = swept(gemm, margin)
    common = overlay(config_table, per_m)
    shapes = {}
    for key in list(shape_table) + [k for k in per_shape if k not in shape_table]:
        table = overlay(shape_table.get(key, config_table), per_shape.get(key, {}))
        if table != common:
            shapes[key] = table
    return common, shapes


def shipped_tables() -> tuple[Table, dict[tuple[int, int], Table]]:
    """engine/kernels/int8_gemm.py's CONFIG_TABLE and SHAPE_TABLE as (max_m, config string)."""
    from engine.kernels.int8_gemm import CONFIG_TABLE, SHAPE_TABLE

    return [(m, str(c)) for m, c in CONFIG_TABLE], {
        key: [(m, str(c)) for m, c in t] for key, t in SHAPE_TABLE.items()
    }


def source(common: Table, shapes: dict[tuple[int, int], Table]) -> str:
    """Python source of the two tables, as int8_gemm.py spells them."""
    out = ["CONFIG_TABLE: tuple[tuple[int, GemmConfig], ...] = ("]
    out += [f"    ({'1 << 62' if m == 1 << 62 else m}, {config_source(c)})," for m, c in common]
    out += [")", "SHAPE_TABLE: dict[tuple[int, int], tuple[tuple[int, GemmConfig], ...]] = {"]
    for (n, k), table in shapes.items():
        out.append(f"    ({n}, {k}): (")
        out += [f"        ({'1 << 62' if m == 1 << 62 else m}, {config_source(c)})," for m, c in table]
        out.append("    ),")
    out.append("}")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json")
    ap.add_argument("--margin", type=float, default=0.03)
    ap.add_argument(
        "--merge",
        action="store_true",
        help="replace only the swept M buckets of the shipped tables (for a sweep of a few Ms)",
    )
    args = ap.parse_args()
    with open(args.json) as f:
        data = json.load(f)
    gemm = data.get("gemm", data)
    if args.merge:
        common, shapes = merged_tables(gemm, args.margin, *shipped_tables())
    else:
        common, shapes = tables(gemm, args.margin)
    print(source(common, shapes), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
