"""A seeded generator of synthetic AIOps alerts and tickets with ground-truth labels.

Why: the demo model is trained on these and `prism eval` scores any model on them, so the rules
that decide each label live here, in one place, readable by a person checking a decision by eye
(the module's length is those rules and their wording tables, kept together on purpose).
The event families and their questions are the ones of the bundled `sample_events.jsonl` (same
instructions, same options), so the trained model answers the demo's events in its own domain.

Rules (each label is a function of the evidence, except where marked ambiguous):
- services have owners (`SERVICE_OWNERS`); 5xx alerts: severity from the error rate, action
  needed from error rate or p99 latency, noise when the rate is near its baseline;
- disk pressure: urgency from the used share and growth, the owner from the host's role;
- OOM kills: a deploy in the last hour with many restarts is a bad deploy (roll back);
- certificates: days left and auto-renewal decide the next step and urgency;
- deploy regressions: roll back when the error rate rose at least fourfold;
- login failures: many source IPs or a foreign login is a security incident;
- tickets: refund/credit wording means a refund request, churn threats mean an angry customer,
  exclamation or repeated failure a frustrated one; the topic decides the owner;
- noise alerts: CPU saturation during a scheduled job is noise.
About `AMBIGUOUS_SHARE` of the events sit on a rule's boundary, where the evidence does not
decide: their label is a fair coin, drawn from the seed, and they are marked `ambiguous`.

A labelled line is an event (the pipeline's evidence shape, so `prism backfill` takes it) plus
`labels` (question id -> option id: `yes`/`no` for noul, the option key for choice, the level
index `"0".."n-1"` for score) and `ambiguous` (question ids whose label is a coin).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

AMBIGUOUS_SHARE = 0.06
THOUGHT_TEXT = "I weigh the evidence against each option."  # the short thought the demo model learns

# The questions of the bundled sample events, verbatim (instructions and options).
NEEDS_ACTION = {"type": "noul", "instructions": "Does this need a human to act within the next hour?"}
OWNER = {
    "type": "choice",
    "instructions": "Which team should own this?",
    "criteria": {
        "platform": "compute, kubernetes and storage",
        "database": "postgres, redis and backups",
        "network": "load balancers, DNS and certificates",
        "identity": "login, SSO and MFA",
        "payments": "billing and checkout",
        "support": "customer support desk",
    },
}
URGENCY = {
    "type": "score",
    "instructions": "How urgent is a response?",
    "criteria": ["informational", "low", "medium", "high", "page now"],
}
SEVERITY = {
    "type": "score",
    "instructions": "How severe is this incident?",
    "criteria": [
        "sev4: no user impact",
        "sev3: minor impact",
        "sev2: degraded service",
        "sev1: customer-facing outage",
    ],
}
NOISE = {
    "type": "noul",
    "instructions": "Is this alert likely a false positive or flapping?",
    "criteria": {"true": "noise, safe to suppress", "false": "a real problem"},
}
ROLLBACK = {"type": "noul", "instructions": "Should the most recent deploy be rolled back?"}
SECURITY = {"type": "noul", "instructions": "Could this be a security incident?"}
REFUND = {"type": "noul", "instructions": "Is the customer asking for a refund or credit?"}
MOOD = {
    "type": "choice",
    "instructions": "What is the customer's mood?",
    "criteria": {"calm": None, "frustrated": None, "angry": "threatens to churn or escalate"},
}
OOM_CAUSE = {
    "type": "choice",
    "instructions": "What is the most likely cause?",
    "criteria": {
        "leak": "memory leak in the service",
        "limit_too_low": "limit too low for normal load",
        "traffic_spike": "unusual traffic",
        "bad_deploy": "regression from a recent deploy",
    },
}
DISK_CAUSE = {
    "type": "choice",
    "instructions": "What is the most likely cause?",
    "criteria": {
        "logs": "log files not rotated",
        "data_growth": "normal data growth",
        "tmp_files": "leftover temp or core dumps",
        "snapshot": "snapshots kept too long",
    },
}
CERT_NEXT = {
    "type": "choice",
    "instructions": "What should happen next?",
    "criteria": {
        "renew_now": "renew and deploy the certificate today",
        "verify_auto_renew": "check the renewal job",
        "ignore": "nothing to do",
    },
}

SERVICE_OWNERS = {
    "checkout-api": "payments",
    "payments-webhook": "payments",
    "billing": "payments",
    "invoice-service": "payments",
    "login": "identity",
    "sso-gateway": "identity",
    "mfa": "identity",
    "search": "platform",
    "graphql": "platform",
    "scheduler": "platform",
    "cdn-edge": "network",
    "dns-resolver": "network",
    "ingress-lb": "network",
    "postgres-main": "database",
    "redis-cache": "database",
    "db-proxy": "database",
}
HOST_ROLES = {
    "web": "platform",
    "api": "platform",
    "batch": "platform",
    "db": "database",
    "redis": "database",
}
UPSTREAM = ["connection reset", "timeout", "503 from db-proxy", "TLS handshake failed"]


class Builder:
    """Collects one event's questions and labels; `coin` marks the boundary cases."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.questions: dict[str, dict[str, Any]] = {}
        self.labels: dict[str, str] = {}
        self.ambiguous: list[str] = []

    def ask(self, qid: str, question: dict[str, Any], label: str, ambiguous: bool = False) -> None:
        if ambiguous:
            options = _options(question)
            label = self.rng.choice(options)
            self.ambiguous.append(qid)
        self.questions[qid] = question
        self.labels[qid] = label


def _options(question: dict[str, Any]) -> list[str]:
    if question["type"] == "noul":
        return ["yes", "no"]
    if question["type"] == "score":
        return [str(i) for i in range(len(question["criteria"]))]
    return list(question["criteria"])


def _yn(flag: bool) -> str:
    return "yes" if flag else "no"


def _boundary(rng: random.Random) -> bool:
    return rng.random() < AMBIGUOUS_SHARE


# ------------------------------------------------------------------------------------- families
def _http_errors(rng: random.Random, b: Builder) -> tuple[str, Any]:
    service = rng.choice(list(SERVICE_OWNERS))
    band = rng.choice(["low", "minor", "degraded", "outage"])
    amb = _boundary(rng)
    rate = {
        "low": rng.uniform(0.2, 0.9),
        "minor": rng.uniform(2.0, 4.5),
        "degraded": rng.uniform(8.0, 18.0),
        "outage": rng.uniform(25.0, 65.0),
    }[band]
    base = rng.choice([0.1, 0.2, 0.3, 0.4, 0.5])
    slow = rng.random() < 0.3
    latency = rng.randint(1600, 4000) if slow else rng.randint(120, 900)
    text = (
        f"5xx rate on {service} is {rate:.1f}% over the last 10 minutes (baseline {base:.1f}%). "
        f"p99 latency {latency} ms. Upstream errors: {rng.choice(UPSTREAM)}."
    )
    b.ask("needs_action", NEEDS_ACTION, _yn(band != "low" or slow))
    b.ask("owner", OWNER, SERVICE_OWNERS[service])
    sev = {"low": 0, "minor": 1, "degraded": 2, "outage": 3}[band]
    if rng.random() < 0.7:
        b.ask("severity", SEVERITY, str(sev), ambiguous=amb)
    if rng.random() < 0.5:
        b.ask("noise", NOISE, _yn(band == "low" and not slow))
    return "alert", text


def _disk(rng: random.Random, b: Builder) -> tuple[str, Any]:
    role = rng.choice(list(HOST_ROLES))
    used = rng.choice([rng.randint(70, 84), rng.randint(86, 93), rng.randint(96, 99)])
    growth = round(rng.choice([rng.uniform(0.1, 0.9), rng.uniform(2.5, 6.0)]), 1)
    env = rng.choice(["prod", "staging"])
    mount = rng.choice(["/", "/var/lib/data", "/var/log", "/tmp"])
    state = {
        "alert": "DiskPressure",
        "host": f"{role}-{rng.randint(1, 20):02d}",
        "mount": mount,
        "used_percent": used,
        "growth_gb_per_hour": growth,
        "inodes_used_percent": rng.randint(10, 60),
        "labels": {"env": env},
    }
    fast = growth >= 2.0
    urgency = 1 if used < 85 else 2 if used < 95 else 3
    if fast and used >= 85:
        urgency += 1
    if env == "staging":
        urgency = max(0, urgency - 1)
    b.ask("needs_action", NEEDS_ACTION, _yn(urgency >= 3))
    b.ask("owner", OWNER, HOST_ROLES[role])
    b.ask("urgency", URGENCY, str(urgency), ambiguous=_boundary(rng))
    if rng.random() < 0.5:
        cause = {"/var/log": "logs", "/tmp": "tmp_files"}.get(
            mount, "data_growth" if not fast else "snapshot"
        )
        b.ask("cause", DISK_CAUSE, cause)
    return "alert", state


def _oom(rng: random.Random, b: Builder) -> tuple[str, Any]:
    service = rng.choice(["checkout", "search", "graphql", "billing", "scheduler"])
    kind = rng.choice(["bad_deploy", "leak", "limit_too_low", "traffic_spike"])
    deploy_ago = rng.randint(5, 50) if kind == "bad_deploy" else rng.randint(300, 5000)
    restarts = rng.randint(8, 30) if kind in ("bad_deploy", "traffic_spike") else rng.randint(1, 4)
    state: dict[str, Any] = {
        "alert": "OOMKilled",
        "pod": f"{service}-{rng.randrange(16**6):06x}-{rng.randrange(36**4):04x}",
        "namespace": "prod",
        "container": service,
        "memory_limit_mib": 128 if kind == "limit_too_low" else rng.choice([512, 1024, 2048]),
        "restarts_last_hour": restarts,
        "last_deploy_minutes_ago": deploy_ago,
    }
    if kind == "traffic_spike":
        state["requests_per_second"] = f"{rng.randint(4, 9)}x normal"
    if kind == "leak":
        state["memory_trend"] = "steady climb since start"
    b.ask("needs_action", NEEDS_ACTION, _yn(restarts >= 8))
    b.ask("cause", OOM_CAUSE, kind)
    b.ask("severity", SEVERITY, "2" if restarts >= 8 else "1", ambiguous=_boundary(rng))
    b.ask("rollback", ROLLBACK, _yn(kind == "bad_deploy"))
    return "alert", state


def _certificate(rng: random.Random, b: Builder) -> tuple[str, Any]:
    days = rng.choice([rng.randint(1, 6), rng.randint(15, 25), rng.randint(40, 90)])
    auto = rng.random() < 0.5
    state = {
        "alert": "CertificateExpiry",
        "domain": f"{rng.choice(['api', 'www', 'login', 'pay'])}.acme.example",
        "days_left": days,
        "issuer": rng.choice(["internal-ca", "letsencrypt"]),
        "auto_renew": auto,
    }
    soon = days <= 7
    if days > 30:
        step, urgency = "ignore", 0
    elif soon and not auto:
        step, urgency = "renew_now", 4
    elif soon:
        step, urgency = "verify_auto_renew", 3
    else:
        step, urgency = ("verify_auto_renew", 1) if auto else ("renew_now", 2)
    b.ask("needs_action", NEEDS_ACTION, _yn(soon))
    b.ask("urgency", URGENCY, str(urgency))
    b.ask("next_step", CERT_NEXT, step)
    if rng.random() < 0.3:
        b.ask("owner", OWNER, "network")
    return "alert", state


def _deploy(rng: random.Random, b: Builder) -> tuple[str, Any]:
    service = rng.choice(list(SERVICE_OWNERS))
    before = rng.choice([0.1, 0.2, 0.3, 0.5])
    bad = rng.random() < 0.5
    amb = _boundary(rng)
    after = round(before * rng.uniform(6.0, 40.0), 1) if bad else round(before * rng.uniform(0.8, 1.6), 1)
    state = {
        "alert": "DeployRegression",
        "service": service,
        "version": f"v2.{rng.randint(10, 60)}.{rng.randint(0, 9)}",
        "deployed_minutes_ago": rng.randint(3, 90),
        "canary": rng.random() < 0.5,
        "signal": f"error rate up from {before}% to {after}%",
    }
    b.ask("rollback", ROLLBACK, _yn(bad), ambiguous=amb)
    b.ask("severity", SEVERITY, "2" if bad and after >= 5 else "1" if bad else "0")
    b.ask("owner", OWNER, SERVICE_OWNERS[service])
    b.ask("needs_action", NEEDS_ACTION, _yn(bad))
    return "alert", state


def _login(rng: random.Random, b: Builder) -> tuple[str, Any]:
    attack = rng.random() < 0.5
    ips = rng.randint(8, 60) if attack else rng.randint(1, 2)
    state = {
        "alert": "LoginFailures",
        "account": rng.choice(["j.smith", "a.jones", "m.lee", "svc-deploy", "k.ng"]),
        "failures_15m": rng.randint(20, 300) if attack else rng.randint(3, 9),
        "distinct_source_ips": ips,
        "countries": rng.sample(["NL", "DE", "US", "BR", "RU", "CN", "IN"], 3) if attack else ["NL"],
        "mfa_enabled": rng.random() < 0.5,
    }
    b.ask("security", SECURITY, _yn(attack), ambiguous=_boundary(rng))
    b.ask("owner", OWNER, "identity")
    b.ask("urgency", URGENCY, ("4" if not state["mfa_enabled"] else "3") if attack else "1")
    return "alert", state


def _noise(rng: random.Random, b: Builder) -> tuple[str, Any]:
    scheduled = rng.random() < 0.5
    host = f"{rng.choice(['batch', 'web', 'api'])}-{rng.randint(1, 20):02d}"
    why = (
        f"the nightly {rng.choice(['report', 'backup', 'export', 'index'])} job is running as scheduled"
        if scheduled
        else "no scheduled job is running and requests are queueing"
    )
    text = f"CPU on {host} at {rng.randint(95, 100)}% for {rng.randint(20, 90)} minutes; {why}."
    b.ask("noise", NOISE, _yn(scheduled))
    b.ask("needs_action", NEEDS_ACTION, _yn(not scheduled))
    if rng.random() < 0.4:
        b.ask("owner", OWNER, "platform")
    return "alert", text


TICKET_TOPICS: dict[str, tuple[str, list[str]]] = {
    "billing": (
        "payments",
        [
            "I was charged twice for my {month} invoice (INV-{n}).",
            "Our monthly bill jumped from ${a} to ${b} without any change on our side.",
            "The invoice PDF shows the wrong VAT number for our company.",
            "Checkout fails with a card error for every customer since {day}.",
        ],
    ),
    "login": (
        "identity",
        [
            "Your app logged me out three times today and now says my password is wrong.",
            "SSO with our identity provider stopped working after {day}.",
            "MFA codes are rejected for our whole team.",
        ],
    ),
    "outage": (
        "platform",
        [
            "Your API has been returning 502 for an hour.",
            "Search results are empty since {day} for all our users in the EU region.",
            "Dashboards take minutes to load since {day}.",
        ],
    ),
    "network": (
        "network",
        [
            "Our custom domain shows a certificate warning since {day}.",
            "DNS for our status page does not resolve any more.",
        ],
    ),
    "howto": (
        "support",
        [
            "Could you tell me how to export my dashboards to PDF?",
            "Is there an SLA for the premium plan? Our procurement team asks.",
            "How do I add a second admin to our workspace?",
            "Please delete my account and all my data under GDPR.",
        ],
    ),
}
REFUND_ASKS = [
    "Please refund the duplicate charge.",
    "We want a credit for the downtime.",
    "I expect my money back.",
    "Please issue a refund.",
]
ANGRY = [
    "This is unacceptable, we will cancel.",
    "We are moving to a competitor if this is not fixed today.",
    "I am escalating this to your CEO.",
]
FRUSTRATED = ["I reset it twice already!!", "This is the third time I write about this!", "Still broken!!"]
CALM = ["Thanks.", "Thank you for your help.", "No rush.", ""]


def _ticket(rng: random.Random, b: Builder) -> tuple[str, Any]:
    topic = rng.choice(list(TICKET_TOPICS))
    owner, sentences = TICKET_TOPICS[topic]
    body = rng.choice(sentences).format(
        month=rng.choice(["October", "November", "December"]),
        n=rng.randint(10000, 99999),
        a=rng.randint(100, 900),
        b=rng.randint(1500, 9000),
        day=rng.choice(["this morning", "yesterday", "Monday"]),
    )
    refund = topic in ("billing", "outage") and rng.random() < 0.5
    mood = rng.choice(["calm", "frustrated", "angry"])
    parts = [body]
    if refund:
        parts.append(rng.choice(REFUND_ASKS))
    parts.append(rng.choice({"calm": CALM, "frustrated": FRUSTRATED, "angry": ANGRY}[mood]))
    text = " ".join(p for p in parts if p)
    b.ask("mood", MOOD, mood)
    b.ask("owner", OWNER, owner)
    urgency = {"howto": 0, "network": 2, "login": 2, "billing": 1, "outage": 3}[topic]
    if mood == "angry":
        urgency = min(4, urgency + 1)
    b.ask("urgency", URGENCY, str(urgency), ambiguous=_boundary(rng))
    if rng.random() < 0.6:
        b.ask("refund", REFUND, _yn(refund))
    return "ticket", text


FAMILIES: dict[str, Callable[[random.Random, Builder], tuple[str, Any]]] = {
    "http_errors": _http_errors,
    "disk": _disk,
    "oom": _oom,
    "certificate": _certificate,
    "deploy": _deploy,
    "login": _login,
    "noise": _noise,
    "ticket": _ticket,
}


def generate(n: int, seed: int, split: str = "train") -> Iterator[dict[str, Any]]:
    """`n` labelled events from `seed` (same seed, same events); `split` only names the ids, so
    a hold-out made with another seed never shares an event stream with the training set."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"prism-synth/{seed}")
    names = sorted(FAMILIES)
    for i in range(n):
        family = names[rng.randrange(len(names))]
        b = Builder(rng)
        source, state = FAMILIES[family](rng, b)
        yield {
            "event_id": f"synth-{split}-{seed}-{i:06d}",
            "source": source,
            "tenant": "synth",
            "created_at": f"2026-11-{1 + i % 28:02d}T{i % 24:02d}:00:00Z",
            "request": {"state": state, "questions": b.questions},
            "labels": b.labels,
            "ambiguous": b.ambiguous,
            "family": family,
        }


def main(argv: list[str] | None = None) -> None:
    """Write a labelled JSONL set: `python -m prism_pipeline.synth --n 400 --seed 1 --out x.jsonl`."""
    import argparse
    import sys
    from pathlib import Path

    import orjson

    p = argparse.ArgumentParser(prog="python -m prism_pipeline.synth", description=main.__doc__)
    p.add_argument("--n", type=int, default=400, metavar="EVENTS", help="events to write")
    p.add_argument("--seed", type=int, default=1, metavar="SEED", help="generator seed (hold-out: 1)")
    p.add_argument("--split", default="holdout", metavar="NAME", help="name used in the event ids")
    p.add_argument(
        "--out", type=Path, default=None, metavar="FILE.jsonl", help="output file (default stdout)"
    )
    a = p.parse_args(argv)
    lines = b"".join(orjson.dumps(e) + b"\n" for e in generate(a.n, a.seed, a.split))
    if a.out is None:
        sys.stdout.buffer.write(lines)
    else:
        a.out.write_bytes(lines)


if __name__ == "__main__":
    main()
