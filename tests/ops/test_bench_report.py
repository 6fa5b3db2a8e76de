"""The benchmark's reporting on CPU: latency statistics, the peer ratio, the accuracy comparison,
the fp32 reference weights, and the chart (ops/bench/plot.py) drawn from a bench JSON.

The JSON here is SYNTHETIC (made-up numbers in bench_engine's two layouts): running bench_engine
itself on CPU takes many minutes even at the tiny shape. The chart's PNG needs matplotlib (the GPU
image has it); without it only the numbers the chart draws are checked.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ops" / "bench"))

import bench_engine  # noqa: E402
import plot  # noqa: E402

from engine.quant.linear import QuantLinear  # noqa: E402

SYNTHETIC_SINGLE = {  # one result with its peer nested (bench_engine --peer without --variants)
    "shape": "27B", "device": "synthetic", "variant": "body",
    "a_one_question_256": {"mean_ms": 20.0, "p50_ms": 19.0, "p99_ms": 30.0, "n": 20},
    "b_three_questions_256": {"mean_ms": 25.0, "p50_ms": 24.0, "p99_ms": 40.0, "n": 20},
    "c_one_question_8192": {"mean_ms": 1000.0, "p50_ms": 990.0, "p99_ms": 1100.0, "n": 8},
    "d_64_clients_req_per_s": 40.0,
    "peer": {
        "a_one_question_256": {"mean_ms": 120.0}, "b_three_questions_256": {"mean_ms": 150.0},
        "c_one_question_8192": {"mean_ms": 900.0},
    },
}  # fmt: skip
SYNTHETIC_VARIANTS = {  # --variants body,tc (no (c) in tc) and no peer
    "body": {"variant": "body", "shape": "4B", "device": "synthetic",
             "a_one_question_256": {"mean_ms": 10.0}, "b_three_questions_256": {"mean_ms": 20.0},
             "d_64_clients_req_per_s": 100.0},
    "tc": {"variant": "tc", "shape": "4B", "device": "synthetic",
           "a_one_question_256": {"mean_ms": 5.0}, "b_three_questions_256": {"mean_ms": 30.0}},
}  # fmt: skip


def test_latency_stats_are_the_mean_median_and_tail_of_the_calls() -> None:
    seconds = [0.001 * k for k in range(1, 21)]  # 1..20 ms
    got = bench_engine.latency_stats(seconds)
    assert got["n"] == 20
    assert got["mean_ms"] == pytest.approx(10.5) and got["p50_ms"] == pytest.approx(10.5)
    assert got["p99_ms"] == pytest.approx(19.81)  # inclusive: 19 + 0.81 * (20 - 19)
    assert bench_engine.latency_stats([0.004]) == {"mean_ms": 4.0, "p50_ms": 4.0, "p99_ms": 4.0, "n": 1}


def test_the_peer_ratio_is_peer_over_ours_for_the_workloads_both_ran() -> None:
    ours = {k: v for k, v in SYNTHETIC_SINGLE.items() if k != "c_one_question_8192"}
    got = bench_engine.ratios_to_peer(ours, SYNTHETIC_SINGLE["peer"])
    assert got == {"a_one_question_256": 6.0, "b_three_questions_256": 6.0}


def test_readouts_agree_only_where_the_fp32_margin_is_decisive() -> None:
    want = [[0.7, 0.2, 0.1], [0.45, 0.40, 0.15], [0.1, 0.6, 0.3]]  # margins 0.5, 0.05, 0.3
    got = [[0.6, 0.3, 0.1], [0.40, 0.45, 0.15], [0.5, 0.4, 0.1]]  # 2nd flips (not decisive), 3rd flips
    r = bench_engine.compare_readouts(got, want)
    assert (r["readouts"], r["decisive"], r["argmax_agree"], r["agreement"]) == (3, 2, 1, 0.5)
    assert r["max_abs_dp"] == pytest.approx(0.4)
    deltas = [abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True)]
    assert r["mean_abs_dp"] == pytest.approx(statistics.fmean(deltas))
    none = bench_engine.compare_readouts([[0.5, 0.5]], [[0.5, 0.5]])
    assert none["decisive"] == 0 and none["agreement"] is None


def test_fp32_reference_weights_are_the_int8_weights_dequantized() -> None:
    config = bench_engine.shape_config("tiny")
    g = torch.Generator().manual_seed(0)
    lin = bench_engine.random_int8_linear(8, 16, g, "cpu")
    weights = bench_engine.Weights(
        config=config, token_embd=torch.zeros(2, 16), output_norm=torch.ones(16), output=lin,
        layers=[{"ffn_up": lin, "attn_norm": torch.ones(16)}],
    )  # fmt: skip
    ref = bench_engine.fp32_weights(weights)
    x = torch.randn(3, 16, generator=g)
    want = x.double() @ (lin.qweight.double() * lin.w_scale.double()[:, None]).T
    assert isinstance(ref.output, torch.Tensor) and ref.output.dtype == torch.float32
    torch.testing.assert_close(x @ ref.output.T, want.float())
    assert ref.layers[0]["attn_norm"] is weights.layers[0]["attn_norm"]  # non-linears are shared
    with pytest.raises(ValueError, match="SmoothQuant"):
        bench_engine.fp32_weights(
            bench_engine.Weights(config=config, token_embd=torch.zeros(2, 16), output_norm=torch.ones(16),
                                 output=QuantLinear(lin.qweight, lin.w_scale, torch.ones(16)), layers=[])
        )  # fmt: skip


def test_chart_data_normalizes_to_the_peer() -> None:
    data = plot.chart_data(SYNTHETIC_SINGLE)
    assert data.baseline == "peer" and data.engines == ["body", "peer"]
    assert data.relative["body"] == pytest.approx([20 / 120, 25 / 150, 1000 / 900])
    assert data.relative["peer"] == [1.0, 1.0, 1.0]
    assert data.ms["body"] == [20.0, 25.0, 1000.0]
    assert data.req_per_s == {"body": 40.0, "peer": None}


def test_chart_data_without_a_peer_normalizes_to_the_first_variant() -> None:
    data = plot.chart_data(SYNTHETIC_VARIANTS)
    assert data.baseline == "body" and len(data.workloads) == 2  # nobody ran (c)
    assert data.relative["tc"] == [0.5, 1.5]
    with pytest.raises(ValueError, match="no bench_engine results"):
        plot.chart_data({"accuracy": {}})


@pytest.mark.parametrize("doc", [SYNTHETIC_SINGLE, SYNTHETIC_VARIANTS], ids=["peer", "variants"])
def test_plot_writes_a_png(doc: dict, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    src = tmp_path / "bench.json"
    src.write_text(json.dumps(doc))
    out = tmp_path / "chart.png"
    assert plot.main([str(src), "--out", str(out), "--title", "SYNTHETIC numbers"]) == 0
    head = out.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    assert width > 600 and height > 300
