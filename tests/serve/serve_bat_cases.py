"""JevBench cases for the BAT (batch independence) run: support tickets and alerts with 7-12 mixed
questions each, so `batch_size_sweep` has batches of 2, 5 and 10 to compare."""

from __future__ import annotations

import json
from pathlib import Path

_NOULS = [
    "Is the customer asking for a refund?",
    "Does the message mention a deadline?",
    "Is a payment involved?",
    "Is the customer angry?",
    "Does the message report an outage?",
    "Is a security problem described?",
    "Does the sender ask for a call back?",
]
_CHOICES = [
    (
        "Which team should handle this?",
        {
            "billing": "Charges, invoices, refunds",
            "support": "How-to questions",
            "engineering": "Bugs and outages",
        },
    ),
    (
        "What is the tone?",
        {"calm": "Neutral or polite", "angry": "Upset or hostile", "excited": "Enthusiastic"},
    ),
    (
        "What is the channel?",
        {"email": "A written message", "phone": "A call transcript", "chat": "A live chat"},
    ),
]
_SCORES = [
    ("How urgent is it?", ["Can wait", "Needs attention this week", "Needs attention today"]),
    ("How severe is the impact?", ["None", "Minor", "Major", "Critical"]),
]
_STATES = [
    "Customer writes: I was charged twice for my March invoice. Please refund one charge by Friday.",
    "Alert: api-gateway p99 latency above 2 s for 15 minutes in eu-west-1; error rate 4%.",
    {
        "ticket": 8812,
        "subject": "Cannot log in",
        "body": "Password reset mail never arrives.",
        "tier": "gold",
    },
    "Chat transcript: hi!! your new dashboard is amazing, but where did the export button go?",
    "Security: 40 failed SSH logins for root from one address in 2 minutes on host db-3.",
    "Phone call summary: the customer is furious, their shop has been offline since this morning.",
]


def cases() -> list[dict]:
    out = []
    for i, state in enumerate(_STATES):
        qs: dict[str, dict] = {}
        n_noul = 4 + i % 4
        for j in range(n_noul):
            qs[f"n{j}"] = {"type": "noul", "instructions": _NOULS[(i + j) % len(_NOULS)]}
        for j, (text, criteria) in enumerate(_CHOICES[: 1 + i % 3]):
            qs[f"c{j}"] = {"type": "choice", "instructions": text, "criteria": criteria}
        for j, (text, levels) in enumerate(_SCORES[: 1 + i % 2]):
            qs[f"s{j}"] = {"type": "score", "instructions": text, "criteria": levels}
        out.append({"id": f"bat-{i}", "state": state, "questions": qs})
    return out


def write_cases(path: Path) -> Path:
    path.write_text("".join(json.dumps(c) + "\n" for c in cases()), encoding="utf-8")
    return path


if __name__ == "__main__":
    import sys

    write_cases(Path(sys.argv[1]))
