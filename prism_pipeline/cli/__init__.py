"""The `prism` command line: argument parsing and terminal output, one module a subcommand."""

from prism_pipeline.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
