"""Tensor parallelism (engine.run.tp): 2 ranks (gloo on CPU, NCCL on 2 GPUs) give the bits of one.

Oracles: the single-process int8 engine (every probability, logit and thought compared as
float.hex over the int8 invariance suite's 32 requests, with thoughts, rounds and a prefix
cache hit), and the single-process QuantLinear for the row-parallel linear alone.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from engine.engine import Engine
from engine.quant.linear import QuantLinear
from engine.run.tp import RowParallelLinear, close_group, free_port, init_group, local_config
from engine.testing.make_model import dims_config
from tests.engine.test_int8_invariance import _bits, _requests


def test_local_config_splits_heads_and_features() -> None:
    c = dims_config("tiny")
    local = local_config(c, 2)
    assert (local.linear_num_key_heads, local.linear_num_value_heads) == (1, 2)
    assert (local.num_attention_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 64)
    assert local.conv_dim == c.conv_dim // 2 and local.hidden_size == c.hidden_size
    assert local_config(c, 1) == c
    with pytest.raises(ValueError, match="does not divide"):
        local_config(c, 3)
    with pytest.raises(ValueError, match=">= 1"):
        local_config(c, 0)


def _row_parallel_rank(rank: int, world: int, port: int, out: multiprocessing.Queue) -> None:
    torch.set_num_threads(1)
    tp = init_group(rank, world, torch.device("cpu"), port)
    assert (tp.rank, tp.world) == (rank, world)
    try:
        g = torch.Generator().manual_seed(7)
        full = QuantLinear.from_float(
            torch.randn(24, 96, generator=g), smooth=torch.rand(96, generator=g) + 0.5
        )
        x = torch.randn(13, 96, generator=g) * torch.logspace(-3, 3, 96)  # outlier channels
        x[3] = 0.0  # an all-zero row: scale 0
        cols = torch.arange(rank * 96 // world, (rank + 1) * 96 // world)
        local = QuantLinear(full.qweight[:, cols].contiguous(), full.w_scale, full.smooth[cols].contiguous())
        y = RowParallelLinear(local, tp)(x[:, cols])
        out.put((rank, y.numpy(), full(x).numpy()))  # by value: the rank may exit before it is read
    finally:
        close_group()


@pytest.mark.parametrize("world", [2, 4])
def test_row_parallel_linear_equals_one_device(world: int) -> None:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_row_parallel_rank, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for _, y, oracle in results:
        assert torch.equal(torch.from_numpy(y), torch.from_numpy(oracle))


@pytest.fixture(scope="module")
def q8_model(gguf_model: Callable[..., Path]) -> Path:
    return gguf_model("Q8_0", "tiny", 0, False, 4)  # planted outliers: SmoothQuant is active


DEVICES = [
    "cpu",  # gloo
    pytest.param(
        "cuda",  # nccl
        marks=pytest.mark.skipif(
            not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
        ),
    ),
]


@pytest.mark.parametrize("device", DEVICES)
def test_two_ranks_decide_the_bits_of_one_process(q8_model: Path, device: str) -> None:
    requests = _requests()
    one = Engine.load(q8_model, device=device, precision="int8")
    results = one.decide(requests)
    expected = [_bits(r) for r in results]
    two = Engine.load(q8_model, device=device, precision="int8", tp=2)
    try:
        assert two.tp is not None and two.tp.world == 2
        assert two.config.num_attention_heads == one.config.num_attention_heads // 2
        first = [_bits(r) for r in two.decide(requests)]  # evidence computed
        again = [_bits(r) for r in two.decide(requests[::-1])][::-1]  # evidence from the cache
        assert two.cache.stats.hits >= len(requests)
    finally:
        two.close()
    assert not dist.is_initialized()
    assert any(t.second is not None for r in results for t in r.traces.values())  # thoughts ran
    assert first == expected
    assert again == expected


def test_tensor_parallel_refuses_the_float_paths(q8_model: Path) -> None:
    with pytest.raises(ValueError, match="int8 path only"):
        Engine.load(q8_model, precision="fp32", tp=2)
    assert not dist.is_initialized()


@pytest.mark.slow
def test_four_gloo_ranks_equal_two_and_one(tmp_path: Path) -> None:
    """4-way tensor parallelism on CPU (a tiny model with heads that split 4 ways): 1 = 4 ranks.

    1 = 2 ranks is test_two_ranks_decide_the_bits_of_one_process (with thoughts and the cache);
    integer partial sums are exact however the features are split, so a third engine here (2
    more processes) would check nothing that test and the 4-way split do not.
    """
    from engine.testing.make_model import make_model

    dims = dims_config(
        "tiny", linear_num_key_heads=4, linear_num_value_heads=8, num_attention_heads=8, num_kv_heads=4
    )
    path = make_model(tmp_path / "tiny4-q8.gguf", "Q8_0", dims, 3, False, 4)
    requests = _requests(seed=5)[:12]
    bits = {}
    for tp in (1, 4):
        engine = Engine.load(path, precision="int8", tp=tp)
        try:
            bits[tp] = [_bits(r) for r in engine.decide(requests)]
        finally:
            engine.close()
    assert bits[4] == bits[1]


def test_missing_gpus_are_refused_before_any_process_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.run.tp import check_devices

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_devices("cuda", 2)
    check_devices("cpu", 8)
    with pytest.raises(ValueError, match=r"needs cuda:1..cuda:2; this host has 2 GPU"):
        check_devices("cuda:1", 2)
