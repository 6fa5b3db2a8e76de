"""Tensor parallelism over torch.distributed with integer partial sums: any rank count, same bits.

One process per device. Every rank holds the whole residual stream (token embedding, norms, LM
head replicated) and a contiguous slice of the heads: linear-attention key heads with the value
heads they serve, attention query heads with their K/V heads, and a slice of the MLP's
intermediate features. Column-parallel linears (the projections into heads/features) compute
their slice of the output from the full, identically quantized input, so every column they
produce is the column one device would produce. Row-parallel linears (`ssm_out`,
`attn_output`, `ffn_down`) read a slice of the input features:

    absmax of each row     -> all-reduce MAX  (exact: max has no rounding)
    int8 rows with that scale, int32 partial products over the local features
    int32 partial sums     -> all-reduce SUM  (exact: integer addition in any order)
    the one fp32 epilogue  (acc * row scale) * channel scale

so the scaled output equals the single-device output bit for bit. Everything else a rank
computes is per head or per row and does not depend on how many heads share the device
(`engine.run.executor` reduces attention one K/V head group at a time for that reason; on CPU the
activations come from `engine.run.elementwise`). The thought decoder, whose quantizers are fused
with the op before them, gathers the whole rows first (`RowParallelLinear.gather`) and each
rank multiplies its own features (`from_whole_rows`).

`launch` starts ranks 1..N-1 as follower processes that load the same model and then run the
`Engine.decide` calls rank 0 (the caller's process) sends them, so the engine's API does not
change with the rank count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import multiprocessing
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import structlog
import torch
import torch.distributed as dist

from engine import kernels
from engine.model.config import ModelConfig
from engine.model.weights import Weights
from engine.quant.linear import QuantLinear, quantize_rows_given_absmax

log = structlog.get_logger(__name__)
# Ranks run the same work in lockstep; a collective this late means a rank died or hung.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group (the default torch.distributed group)."""

    rank: int
    world: int

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (pickled)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


# ------------------------------------------------------------------------ row-parallel linear
@dataclass
class RowParallelLinear:
    """A QuantLinear whose input features are split across ranks; see the module docstring."""

    local: QuantLinear  # qweight [N, K_local], w_scale [N] (of the full rows), smooth [K_local]
    tp: TensorParallel
    start: int = 0  # this rank's first input feature
    full_smooth: torch.Tensor | None = None  # s over every input feature (for whole-row quantizers)

    @property
    def shape(self) -> tuple[int, int]:
        return self.local.shape

    @property
    def smooth(self) -> torch.Tensor | None:
        return self.full_smooth

    @property
    def nbytes(self) -> int:
        return self.local.nbytes

    def to(self, device: torch.device | str) -> RowParallelLinear:
        smooth = None if self.full_smooth is None else self.full_smooth.to(device)
        return RowParallelLinear(self.local.to(device), self.tp, self.start, smooth)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x [B, K_local] side by side: the whole input rows [B, K] one device has."""
        parts = [torch.empty_like(x) for _ in range(self.tp.world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def from_whole_rows(
        self, q: torch.Tensor, scale: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The output for whole rows already quantized (q [B, K], scale [B]) as one device would,
        (+ residual, added last): this rank's features' int32 products, summed over ranks."""
        k = self.local.qweight.shape[1]
        return self._reduce_and_scale(q[:, self.start : self.start + k].contiguous(), scale, residual)

    def _reduce_and_scale(
        self, q_own: torch.Tensor, scale: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """int32 products over this rank's features, summed over ranks, then the one epilogue."""
        acc = self.tp.all_reduce_sum(kernels.int8_matmul_exact(q_own, self.local.qweight))
        return kernels.scale_int32(acc, scale, self.local.w_scale, residual)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lin = self.local
        n, k = lin.qweight.shape
        if x.shape[-1] != k:
            raise ValueError(f"RowParallelLinear expects {k} local features, got shape {tuple(x.shape)}")
        lead = x.shape[:-1]
        v = x.reshape(-1, k).float()
        if lin.smooth is not None:
            v = v / lin.smooth
        amax = self.tp.all_reduce_max(v.abs().amax(dim=-1))
        q, scale = quantize_rows_given_absmax(v, amax)
        return self._reduce_and_scale(q, scale).reshape(*lead, n)


# ------------------------------------------------------------------------ sharding
def local_config(config: ModelConfig, world: int) -> ModelConfig:
    """The head and feature counts one rank of `world` holds; a clear error when they do not split."""
    counts = {
        "linear_num_key_heads": config.linear_num_key_heads,
        "linear_num_value_heads": config.linear_num_value_heads,
        "num_attention_heads": config.num_attention_heads,
        "num_kv_heads": config.num_kv_heads,
        "intermediate_size": config.intermediate_size,
    }
    if world < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {world}")
    uneven = {name: n for name, n in counts.items() if n % world}
    if uneven:
        raise ValueError(f"tensor-parallel size {world} does not divide the model's {uneven}")
    return dataclasses.replace(config, **{name: n // world for name, n in counts.items()})


def _rows(lin: object, index: torch.Tensor) -> QuantLinear:
    if not isinstance(lin, QuantLinear):
        raise TypeError("tensor parallelism runs the int8 path only (weights must be QuantLinear)")
    index = index.to(lin.qweight.device)
    return QuantLinear(lin.qweight[index].contiguous(), lin.w_scale[index].contiguous(), lin.smooth)


def _cols(lin: object, index: torch.Tensor, tp: TensorParallel) -> RowParallelLinear:
    if not isinstance(lin, QuantLinear):
        raise TypeError("tensor parallelism runs the int8 path only (weights must be QuantLinear)")
    index = index.to(lin.qweight.device)
    smooth = None if lin.smooth is None else lin.smooth[index].contiguous()
    local = QuantLinear(lin.qweight[:, index].contiguous(), lin.w_scale, smooth)
    return RowParallelLinear(local, tp, int(index[0]), lin.smooth)


def _block(rank: int, world: int, count: int, width: int) -> torch.Tensor:
    """Indices of rank's contiguous share of `count` units of `width` rows each."""
    per = count // world
    return torch.arange(rank * per * width, (rank + 1) * per * width)


def shard_weights(weights: Weights, tp: TensorParallel) -> Weights:
    """This rank's slice of int8 `weights` (see the module docstring for the split)."""
    c, r, w = weights.config, tp.rank, tp.world
    local = local_config(c, w)
    layers: list[dict] = []
    for i, layer in enumerate(weights.layers):
        out = {k: layer[k] for k in ("attn_norm", "post_attention_norm")}
        ffn = _block(r, w, c.intermediate_size, 1)
        out["ffn_gate"], out["ffn_up"] = _rows(layer["ffn_gate"], ffn), _rows(layer["ffn_up"], ffn)
        out["ffn_down"] = _cols(layer["ffn_down"], ffn, tp)
        if c.is_full_attention(i):
            hd = c.head_dim
            out["attn_q"] = _rows(layer["attn_q"], _block(r, w, c.num_attention_heads, 2 * hd))
            kv = _block(r, w, c.num_kv_heads, hd)
            out["attn_k"], out["attn_v"] = _rows(layer["attn_k"], kv), _rows(layer["attn_v"], kv)
            out["attn_output"] = _cols(layer["attn_output"], _block(r, w, c.num_attention_heads, hd), tp)
            out["attn_q_norm"], out["attn_k_norm"] = layer["attn_q_norm"], layer["attn_k_norm"]
        else:
            key = _block(r, w, c.linear_num_key_heads, c.linear_key_head_dim)
            heads = _block(r, w, c.linear_num_value_heads, 1)
            value = _block(r, w, c.linear_num_value_heads, c.linear_value_head_dim)
            kd = c.linear_key_dim
            # conv channels are [q | k | v]; a rank keeps its heads' channels of each, in that order
            channels = torch.cat([key, kd + key, 2 * kd + value])
            out["attn_qkv"] = _rows(layer["attn_qkv"], channels)
            out["ssm_conv1d"] = layer["ssm_conv1d"][channels.to(layer["ssm_conv1d"].device)].contiguous()
            out["attn_gate"] = _rows(layer["attn_gate"], value)
            out["ssm_beta"] = _rows(layer["ssm_beta"], heads)
            out["ssm_alpha"] = _rows(layer["ssm_alpha"], heads)
            dev = layer["ssm_a"].device
            out["ssm_a"] = layer["ssm_a"][heads.to(dev)].contiguous()
            out["ssm_dt"] = layer["ssm_dt"][heads.to(dev)].contiguous()
            out["ssm_norm"] = layer["ssm_norm"]
            out["ssm_out"] = _cols(layer["ssm_out"], value, tp)
        layers.append(out)
    return Weights(
        config=local,
        token_embd=weights.token_embd,
        output_norm=weights.output_norm,
        output=weights.output,
        layers=layers,
    )


def weights_digest(weights: Weights) -> str:
    """A digest of the int8 scales, smoothing factors and float tensors: equal on every rank or
    the ranks quantized differently."""
    h = hashlib.sha256()
    for lin in [weights.output, *(v for layer in weights.layers for v in layer.values())]:
        if isinstance(lin, QuantLinear):
            h.update(lin.w_scale.detach().cpu().numpy().tobytes())
            if lin.smooth is not None:
                h.update(lin.smooth.detach().cpu().numpy().tobytes())
    for layer in weights.layers:
        for v in layer.values():
            if isinstance(v, torch.Tensor):
                h.update(v.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


# ------------------------------------------------------------------------ process group
def rank_device(device: str | torch.device, rank: int) -> torch.device:
    """cuda -> cuda:rank, cuda:k -> cuda:k+rank, cpu stays cpu."""
    device = torch.device(device)
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, world: int, device: torch.device, port: int) -> TensorParallel:
    """Join the group as `rank` (blocks until every rank has arrived)."""
    prepare_rank(world, device)
    return join_group(rank, world, device, port)


def prepare_rank(world: int, device: torch.device) -> None:
    """Per-thread settings of a rank: call it in the thread that will run the engine."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # The host side of a GPU rank is small ops and launches. N ranks each running an
        # all-cores OpenMP pool (whose idle threads spin) beside NCCL's proxy threads starve
        # each other: measured on 2 H200s, a 9k-element float64 sin took 16 ms instead of 0.1.
        torch.set_num_threads(max(1, min(8, (os.cpu_count() or 1) // (2 * world))))
    # NVLink multicast (NVLS) stays off: see the device notes; plain ring/tree all-reduces only.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def join_group(rank: int, world: int, device: torch.device, port: int) -> TensorParallel:
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=COLLECTIVE_TIMEOUT,
        device_id=device if device.type == "cuda" else None,
    )
    return TensorParallel(rank, world)


@dataclass
class Followers:
    """Rank 0's handle on the follower processes (ranks 1..N-1) and the pipes that feed them.

    Work reaches followers through pipes, not collectives: a follower waits for the next call
    as long as the service is idle, while a collective would time out.
    """

    processes: list[multiprocessing.process.BaseProcess]
    pipes: list[Connection]

    def send(self, message: Any) -> None:
        for p, pipe in zip(self.processes, self.pipes, strict=True):
            if not p.is_alive():
                raise RuntimeError(f"tensor-parallel {p.name} has exited (code {p.exitcode})")
            pipe.send(message)

    def join(self, timeout: float = 60.0) -> None:
        for pipe in self.pipes:
            with contextlib.suppress(BrokenPipeError, OSError):
                pipe.send(None)
        for p in self.processes:
            p.join(timeout)
            if p.is_alive():
                p.kill()


def launch(
    world: int,
    device: str | torch.device,
    follower_main: Callable[..., None],
    follower_args: tuple,
) -> tuple[TensorParallel, Followers]:
    """Start ranks 1..world-1 as `follower_main(rank, world, device, port, *args)`; join as rank 0."""
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed group already exists in this process")
    check_devices(device, world)
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    procs, pipes = [], []
    for rank in range(1, world):
        receive, send = ctx.Pipe(duplex=False)
        procs.append(
            ctx.Process(
                target=follower_main,
                args=(rank, world, str(device), port, receive, *follower_args),
                name=f"prism-tp-rank{rank}",
                daemon=True,
            )
        )
        pipes.append(send)
    for p in procs:
        p.start()
    followers = Followers(procs, pipes)
    try:
        first = rank_device(device, 0)
        tp = init_group(0, world, first, port)
    except BaseException:
        followers.join(timeout=5.0)
        raise
    log.info("tp_group_ready", world=world, device=str(device), backend=dist.get_backend())
    return tp, followers


def check_devices(device: str | torch.device, world: int) -> None:
    """A clear error, before any process starts, when the host lacks the GPUs the ranks would use."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    first, have = device.index or 0, torch.cuda.device_count()
    if first + world > have:
        raise ValueError(
            f"tensor-parallel size {world} from {device} needs cuda:{first}..cuda:{first + world - 1}; "
            f"this host has {have} GPU(s)"
        )


def close_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
