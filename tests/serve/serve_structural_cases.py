"""The project's own JevBench cases for the structural relations: five domains (support, infra
alerts, security, billing, logistics), all three question types, option descriptions that show the
name alone (equal to it but for case, spaces, `_` and `-`) and others that do not, and a choice of 30
services (more than 26 options: answered in rounds). Few questions per case, so a run with AutoThink
on stays cheap. JevBench's noul_as_choice draws the choice's option order from the case id and the
question key: three of the five nouls get yes first (the same prompt as the noul), two no first."""

from __future__ import annotations

import json
from pathlib import Path

_NAMES = """auth billing catalog checkout search cart payments shipping inventory email sms push ledger
reports export import gateway cdn dns cache queue scheduler storage backup metrics logging tracing flags
config admin"""
SERVICES = {
    f"svc-{name}": (f"The {name} service" if i % 4 else f"svc {name}")
    for i, name in enumerate(_NAMES.split())
}
assert len(SERVICES) == 30

CASES: list[dict] = [
    {
        "id": "alert-latency",  # first: run_jevbench asks it to see that AutoThink is on (or off)
        "state": "Alert: checkout p99 latency 2.4 s for 15 minutes in eu-west-1; payments error rate 4%.",
        "questions": {
            "paging": {"type": "noul", "instructions": "Should the on-call engineer be paged now?"},
            "service": {
                "type": "choice",
                "instructions": "Which service is the cause?",
                "criteria": SERVICES,
            },
            "severity": {
                "type": "score",
                "instructions": "How severe is it?",
                "criteria": ["None", "Minor", "Major"],
            },
        },
    },
    {
        "id": "support-refund",
        "state": {
            "ticket": 8812,
            "tier": "gold",
            "body": "I was charged twice for March. Refund one by Friday.",
        },
        "questions": {
            "wants_refund": {"type": "noul", "instructions": "Is the customer asking for a refund?"},
            "team": {
                "type": "choice",
                "instructions": "Which team should handle this?",
                "criteria": {
                    "billing": "Charges, invoices, refunds",
                    "support": "Support",
                    "engineering": "Bugs",
                },
            },
            "urgency": {
                "type": "score",
                "instructions": "How urgent is it?",
                "criteria": ["Can wait", "This week", "Today", "Now"],
            },
        },
    },
    {
        "id": "security-ssh",
        "state": "Security: 40 failed SSH logins for root from 203.0.113.9 in 2 minutes on host db-3.",
        "questions": {
            "attack": {"type": "noul", "instructions": "Is this likely an attack?"},
            "action": {
                "type": "choice",
                "instructions": "What should be done first?",
                "criteria": {
                    "block": "Block the address",
                    "ignore": "No action yet",
                    "rotate": "Rotate credentials",
                },
            },
            "risk": {
                "type": "score",
                "instructions": "How risky is it?",
                "criteria": ["Low", "Medium", "High"],
            },
        },
    },
    {
        "id": "billing-dispute",
        "state": "Invoice INV-2291 (4,800 EUR) disputed: the customer says the April discount is missing.",
        "questions": {
            "valid": {"type": "noul", "instructions": "Is the dispute plausible?"},
            "owner": {"type": "choice", "instructions": "Which service owns invoices?", "criteria": SERVICES},
            "amount": {
                "type": "score",
                "instructions": "How large is the amount at stake?",
                "criteria": ["Small", "Medium", "Large"],
            },
        },
    },
    {
        "id": "logistics-delay",
        "state": {"order": "SO-7731", "carrier": "DHL", "status": "held at customs", "days_late": 6},
        "questions": {
            "notify": {"type": "noul", "instructions": "Should the customer be notified?"},
            "cause": {
                "type": "choice",
                "instructions": "What is the cause of the delay?",
                "criteria": {"customs": "Customs", "carrier": "Carrier capacity", "address": "Wrong address"},
            },
            "delay": {
                "type": "score",
                "instructions": "How late is it?",
                "criteria": ["On time", "Late", "Very late"],
            },
        },
    },
]


def write_cases(path: Path, n: int | None = None) -> Path:
    path.write_text("".join(json.dumps(c) + "\n" for c in CASES[:n]), encoding="utf-8")
    return path
