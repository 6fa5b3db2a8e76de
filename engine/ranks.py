"""Tensor-parallel orchestration: rank 0 starts the followers, which load the same engine and run
every `decide` call rank 0 sends them (the collectives themselves live in `engine.run.tp`).

Every rank must run the same steps on the same input: followers load with rank 0's
`LoadOptions` (decision config, path choices, limits: nothing is changed on an engine after
load), receive each call's requests, and take rank 0's broadcast decisions about deadlines and
cancellation.

May import: `engine.run.tp`, `engine.loading`. Not the facade: rank 0 passes its engine class
along, and the follower's entry point builds one with it.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

import structlog
import torch

from engine.loading import LoadOptions
from engine.run.tp import Followers, TensorParallel, close_group, init_group, launch, rank_device


class Follower(Protocol):
    """What a follower rank's loop needs of its engine."""

    tp: TensorParallel | None

    def decide_as_follower(self, requests: list[Any], mode: str) -> None: ...


class EngineClass(Protocol):
    """What the follower's entry point needs of the engine class rank 0 passes."""

    def load_rank(self, path: str, device: str, options: LoadOptions, tp: TensorParallel) -> Follower: ...


log = structlog.get_logger(__name__)


def start_followers(
    world: int, device: str, path: str | Path, options: LoadOptions, engine_class: EngineClass
) -> tuple[str, TensorParallel, Followers]:
    """Start ranks 1..world-1 loading `path` with `options` through `engine_class.load_rank`;
    rank 0's device, group and handle."""
    args = (str(path), options, torch.get_num_threads(), engine_class)
    group, followers = launch(world, device, _follower_main, args)
    return str(rank_device(device, 0)), group, followers


def follow(engine: Follower, pipe: Connection) -> None:
    """A follower rank's loop: run every decide call rank 0 sends, until it closes the pipe."""
    while True:
        try:
            message = pipe.recv()
        except EOFError:
            return
        if message is None:
            return
        _, requests, mode = message
        try:
            engine.decide_as_follower(requests, mode)
        except Exception as e:  # rank 0 runs the same code on the same input: it raises too
            log.warning("tp_follower_decide_failed", rank=engine.tp and engine.tp.rank, error=repr(e))


def _follower_main(
    rank: int,
    world: int,
    device: str,
    port: int,
    pipe: Connection,
    path: str,
    options: LoadOptions,
    threads: int,
    engine_class: EngineClass,
) -> None:
    """Entry point of tensor-parallel ranks 1..N-1 (a spawned process)."""
    torch.set_num_threads(threads)
    dev = rank_device(device, rank)
    tp = init_group(rank, world, dev, port)
    try:
        engine = engine_class.load_rank(path, str(dev), options, tp)
        follow(engine, pipe)
    finally:
        close_group()
