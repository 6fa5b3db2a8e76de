"""Prefix-cache benchmark (CPU): a follow-up question on cached ~2,000-token evidence.

For each of N requests with unique ~2,000-token evidence: decide one question (a miss: the
evidence runs), then decide a different question about the same evidence (a hit: only the
question's tokens run). Reports the forest counters and wall time of both, and the same
follow-up with the cache off (cold), so the time saved is measured in the same session.

    python ops/bench/bench_cache_cpu.py --dims small --requests 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine.engine import Engine
from engine.testing.make_model import make_model
from engine.types import DecideRequest
from schemas.systemone import SystemOneRequest

WORDS = ["disk", "latency", "pod", "oom", "restart", "5xx", "db-3", "us-east", "cert", "deploy", "queue"]


def evidence(i: int, n_words: int) -> str:
    g = torch.Generator().manual_seed(1000 + i)
    idx = torch.randint(0, len(WORDS), (n_words,), generator=g).tolist()
    return f"incident {i}: " + " ".join(WORDS[j] for j in idx)


def request(state: str, qid: str, text: str) -> SystemOneRequest:
    question = {"type": "noul", "instructions": text}
    return SystemOneRequest.model_validate({"state": state, "questions": {qid: question}})


def timed(engine: Engine, req: DecideRequest) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    engine.decide([req])
    return time.perf_counter() - t0, [sum(c.tokens_per_level) for c in engine.last_counters]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="small")
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--words", type=int, default=1000, help="evidence words (~2 tokens each)")
    ap.add_argument("--precision", default="fp32")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp) / "m.gguf", "Q8_0", args.dims, 0)
        warm = Engine.load(path, precision=args.precision)
        cold = Engine.load(path, precision=args.precision, cache_bytes=0)
        rows = []
        for i in range(args.requests):
            state = evidence(i, args.words)
            ev_tokens = len(warm.prompts.evidence_ids(state))
            first = DecideRequest(f"e{i}", request(state, "urgent", "Is this urgent?"), gate=0.0)
            follow = DecideRequest(f"f{i}", request(state, "db", "Is the database involved?"), gate=0.0)
            miss_s, miss_tokens = timed(warm, first)
            hit_s, hit_tokens = timed(warm, follow)
            cold_s, cold_tokens = timed(cold, follow)
            rows.append((ev_tokens, miss_s, miss_tokens, hit_s, hit_tokens, cold_s, cold_tokens))
        print(f"model {args.dims} Q8_0, {args.precision}, threads {torch.get_num_threads()}")
        print("evidence_tokens  first(miss) ms/tokens  follow-up(hit) ms/tokens  follow-up cold ms/tokens")
        for ev, ms, mt, hs, ht, cs, ct in rows:
            miss, hit, cold_ms = (
                f"{1e3 * ms:.1f} / {sum(mt)}",
                f"{1e3 * hs:.1f} / {sum(ht)}",
                f"{1e3 * cs:.1f}",
            )
            print(f"{ev:>15}  {miss:>22}  {hit:>25}  {cold_ms:>10} / {sum(ct)}")
        hit = statistics.fmean(r[3] for r in rows[1:] or rows)
        cold_mean = statistics.fmean(r[5] for r in rows[1:] or rows)
        stats = warm.cache.stats
        print(
            f"mean follow-up: hit {1e3 * hit:.1f} ms, cold {1e3 * cold_mean:.1f} ms ({cold_mean / hit:.1f}x)"
        )
        print(f"cache: hits {stats.hits}, misses {stats.misses}, bytes {stats.bytes}")


if __name__ == "__main__":
    main()
