"""Static-shape buckets and their CUDA graphs: the one capture routine of the body and the decoder.

Both graph-captured passes (`engine.run.body`, `engine.run.decoder`) keep one bucket per shape:
static tensors the pass reads, loaded with each run's tables. On CUDA a bucket's pass is captured
once - a warm-up run on a side stream compiles every kernel first, with the bucket's tables all
padding, then the capture into a shared memory pool - and replayed for every later run that
fits; elsewhere (or with `graphs=False`) the same pass runs eagerly: same kernels, same bits.

May import: torch only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import torch


class Captured(Protocol):
    """A bucket as this module needs it: where its graph and the graph's output are kept."""

    graph: torch.cuda.CUDAGraph | None
    logits: torch.Tensor | None


B = TypeVar("B", bound=Captured)


def fit(n: int, ladder: tuple[int, ...]) -> tuple[int, bool]:
    """The smallest ladder entry >= n, or n itself (and False: too big for a captured graph)."""
    for b in ladder:
        if b >= n:
            return b, True
    return n, False


class BucketGraphs:
    """Runs a bucket's pass through its CUDA graph (captured on first use) or eagerly."""

    def __init__(self, device: torch.device, graphs: bool | None) -> None:
        self.enabled = (device.type == "cuda") if graphs is None else graphs
        if self.enabled and device.type != "cuda":
            raise ValueError("CUDA graphs need CUDA weights")
        self.device = device
        self._pool = torch.cuda.graph_pool_handle() if self.enabled else None

    def run(
        self,
        bucket: B,
        forward: Callable[[B], torch.Tensor],
        load: Callable[[], None],
        load_padding: Callable[[], None],
        *,
        capturable: bool = True,
    ) -> tuple[torch.Tensor, bool]:
        """`load()` this run's tables into the bucket, then the pass's output: the graph's replay
        when graphs are on and the shape `capturable`, else `forward(bucket)`. Also whether this
        call captured the bucket's graph (the caller logs it)."""
        use_graph = self.enabled and capturable
        captured = False
        if use_graph and bucket.graph is None:
            self._capture(bucket, forward, load_padding)
            captured = True
        load()
        if use_graph:
            assert bucket.graph is not None and bucket.logits is not None
            bucket.graph.replay()
            return bucket.logits, captured
        return forward(bucket), captured

    def _capture(
        self, bucket: B, forward: Callable[[B], torch.Tensor], load_padding: Callable[[], None]
    ) -> None:
        load_padding()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            forward(bucket)  # compiles every kernel before capture
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            bucket.logits = forward(bucket)
        bucket.graph = graph
