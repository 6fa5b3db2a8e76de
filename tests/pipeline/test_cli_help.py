"""Every option of `prism run/serve/backfill/replay --help` has a description and a real
placeholder, and a required `--model` says so (the newcomer's first read)."""

from __future__ import annotations

import argparse

import pytest

from prism_pipeline.cli import build_parser
from prism_pipeline.cli.helptext import COMMANDS


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_has_a_description_and_a_placeholder(command: str) -> None:
    p = _subparser(command)
    for action in p._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        description = (action.help or "").split("[PRISM_")[0].strip()
        assert description, f"{command} {name} has no description"
        if action.nargs == 0 or action.choices:
            continue
        # argparse's own placeholder is the dest upper-cased: DECISION_CONFIG, MAX_WAIT_MS
        shown = action.metavar
        default_shown = shown == action.dest.upper() and "_" in shown
        assert shown not in (None, "V") and not default_shown, f"{command} {name}: {shown!r}"
    text = p.format_help()
    assert " V " not in text and " V\n" not in text
    model = next(a for a in p._actions if a.dest == "model")
    assert "required" in (model.help or "")
