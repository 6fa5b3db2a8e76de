"""Turn a GEMM sweep's JSON (bench_kernels.py --gemm-only --out) into CONFIG_TABLE / SHAPE_TABLE.

    python3 ops/bench/gemm_table.py gemm_sweep.json [--margin 0.03]

Prints Python source for engine/kernels/int8_gemm.py. The rule, so the table is reproducible:
- CONFIG_TABLE: per swept M, the one bit-exact config with the least decode-step-weighted time
  summed over every swept linear of every model (the sweep's `proposal.per_m`);
- SHAPE_TABLE: per weight shape (N, K), at each swept M, that shape's own best config where it
  beats the CONFIG_TABLE config at that M by more than `margin` (else the CONFIG_TABLE one, so
  timing noise does not scatter configs); a shape whose entries all equal CONFIG_TABLE is left out.
Each swept M is the largest M of its bucket: M in (previous swept M, this M] runs its config.
Consecutive buckets with the same config merge. Every config gives the same bits (the sweep
checked each against the reference), so the table is a choice of speed only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

_CFG = re.compile(
    r"(\d+)x(\d+)x(\d+)/w(\d+)/s(\d+)(?:/g(\d+))?(?:/split(\d+)(\+pass)?)?(/tma)?(?:/e(\d+))?(/ws)?(/gemv)?$"
)


def config_source(name: str) -> str:
    """`GemmConfig(...)` source for a config's str() (the sweep's JSON keys)."""
    m = _CFG.match(name)
    if m is None:
        raise ValueError(f"not a GemmConfig string: {name!r}")
    bm, bn, bk, w, s, g, split, unfused, tma, epi, ws, gemv = m.groups()
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


def tables(gemm: dict, margin: float) -> tuple[Table, dict[tuple[int, int], Table]]:
    """(CONFIG_TABLE, SHAPE_TABLE) as (max_m, config string) lists, by the module's rule."""
    rows = gemm["rows"]
    per_m = {int(m): c for m, c in gemm["proposal"]["per_m"].items()}
    ms = sorted(per_m)
    common = merge([(m, per_m[m]) for m in ms])
    shapes: dict[tuple[int, int], list[tuple[int, str]]] = {}
    for n, k in dict.fromkeys((r["n"], r["k"]) for r in rows):
        entries = []
        for m in ms:
            rs = [r for r in rows if (r["n"], r["k"]) == (n, k) and r["m"] == m and r["candidates"]]
            base = per_m[m]
            if not rs or any(base not in r["candidates"] for r in rs):
                entries.append((m, base))
                continue
            # the shape's rows at this M (a shape used twice, e.g. two +res projections, sums)
            exact = set.intersection(*({c for c, v in r["candidates"].items() if v["bit_equal"]} for r in rs))
            t = {c: sum(r["candidates"][c]["ms"] for r in rs) for c in exact}
            best = min(t, key=t.get)
            entries.append((m, best if t[best] < (1 - margin) * t[base] else base))
        merged = merge(entries)
        if merged != common:
            shapes[(n, k)] = merged
    return common, shapes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json")
    ap.add_argument("--margin", type=float, default=0.03)
    args = ap.parse_args()
    with open(args.json) as f:
        data = json.load(f)
    common, shapes = tables(data.get("gemm", data), args.margin)
    print("CONFIG_TABLE: tuple[tuple[int, GemmConfig], ...] = (")
    for m, c in common:
        print(f"    ({'1 << 62' if m == 1 << 62 else m}, {config_source(c)}),")
    print(")")
    print("SHAPE_TABLE: dict[tuple[int, int], tuple[tuple[int, GemmConfig], ...]] = {")
    for (n, k), table in shapes.items():
        print(f"    ({n}, {k}): (")
        for m, c in table:
            print(f"        ({'1 << 62' if m == 1 << 62 else m}, {config_source(c)}),")
        print("    ),")
    print("}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
