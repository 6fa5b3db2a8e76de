"""Placeholders and descriptions for the options of `prism run/serve/backfill/replay`.

Why: a newcomer reads `--help` first; an option shown as `--tp V` or with an empty description
teaches nothing. The parsers are built in several modules (and `prism run`'s from the settings
model), so the placeholders live in one table here and `polish` applies them to every
subcommand after the parser is built; tests/pipeline/test_cli_help.py holds every option of
those commands to a description and a real placeholder.
"""

from __future__ import annotations

import argparse

# dest -> what the value looks like
METAVARS: dict[str, str] = {
    "brokers": "HOST:PORT[,...]",
    "input_topic": "TOPIC",
    "output_topic": "TOPIC",
    "dlq_topic": "TOPIC",
    "group_id": "GROUP",
    "model": "MODEL.gguf",
    "mmproj": "MMPROJ.gguf",
    "decision_config": "CONFIG.json",
    "device": "DEVICE",
    "tp": "N",
    "batch_tokens": "TOKENS",
    "max_wait_ms": "MS",
    "max_batch_events": "N",
    "max_queued_batches": "N",
    "gate": "P",
    "max_gate": "P",
    "thought_budget": "TOKENS",
    "fixed_seed": "SEED",
    "seed": "SEED",
    "max_questions": "N",
    "max_state_chars": "CHARS",
    "transactional_id_prefix": "PREFIX",
    "metrics_port": "PORT",
    "worker_id": "ID",
    "commit_interval_ms": "MS",
    "revoke_timeout_s": "SECONDS",
    "stop_timeout_s": "SECONDS",
    "heartbeat_interval_ms": "MS",
    "max_poll_records": "N",
    "session_timeout_ms": "MS",
    "max_poll_interval_ms": "MS",
    "host": "ADDRESS",
    "port": "PORT",
    "api_key": "KEY",
    "name": "NAME",
    "alias": "NAME",
    "max_batch_requests": "N",
    "max_pending": "N",
    "max_body_bytes": "BYTES",
    "deadline_s": "SECONDS",
    "max_request_tokens": "TOKENS",
    "max_header_bytes": "BYTES",
    "max_headers": "N",
    "header_timeout_s": "SECONDS",
    "body_timeout_s": "SECONDS",
    "max_connections": "N",
    "drain_s": "SECONDS",
    "input": "EVENTS.jsonl[.gz]",
    "partition": "PARTITION",
    "from_offset": "OFFSET",
    "to_offset": "OFFSET",
    "output": "RECORDS.jsonl[.gz]",
    "dlq": "DEAD.jsonl",
    "checkpoint": "CHECKPOINT.json",
    "chunk_events": "N",
    "records": "TOPIC",
    "topic": "TOPIC",
    "from_time": "TIME",
    "to_time": "TIME",
    "event_id": "EVENT",
    "max_diffs": "N",
}

# dest -> description, for options whose parser gives none
DESCRIPTIONS: dict[str, str] = {
    "device": "engine device: cpu, cuda or cuda:N (default cpu)",
    "precision": "precision path: int8, bf16 or fp32; auto is int8 on CUDA and fp32 on CPU",
    "seed_policy": (
        "which seed a record's thoughts draw from: event (the event's seed, else one derived from "
        "its id), id (always derived from the id) or fixed (--fixed-seed)"
    ),
    "fixed_seed": "the seed of every event under --seed-policy fixed",
    "max_questions": "questions per event; more and the event is dead-lettered",
    "max_state_chars": "characters of state per event; more and the event is dead-lettered",
}

COMMANDS = ("run", "serve", "backfill", "replay")
REQUIRED_NOTE = "(required)"


def _takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0 and not isinstance(action, argparse._HelpAction)


def _description(action: argparse.Action) -> str:
    """The help text without the `[PRISM_...]` environment/default tail."""
    return (action.help or "").split("[PRISM_")[0].strip()


def polish(parser: argparse.ArgumentParser, commands: tuple[str, ...] = COMMANDS) -> None:
    """Give every option of `commands` a placeholder and a description (see the module docstring)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for sub in subs:
        for name in commands:
            p = sub.choices.get(name)
            if p is None:
                continue
            for action in p._actions:
                if not _takes_value(action):
                    continue
                if not action.choices and action.metavar in (None, "V"):
                    action.metavar = METAVARS.get(action.dest, action.dest.upper())
                if not _description(action) and action.dest in DESCRIPTIONS:
                    action.help = f"{DESCRIPTIONS[action.dest]} {action.help or ''}".strip()
                if action.dest == "model" and REQUIRED_NOTE not in (action.help or ""):
                    action.help = f"{REQUIRED_NOTE} {action.help or ''}".strip()
