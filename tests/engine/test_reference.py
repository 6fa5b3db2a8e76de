"""The reference forward against HF transformers' Qwen3.5, and its stateful/selection properties.

Weights are random but well-conditioned canonical tensors for tiny configs where
num_v_heads != num_k_heads and k_head_dim != v_head_dim, so head grouping and S's axes are
exercised. Error metric: per position, max|ours - hf| / max|hf| over the vocabulary; the test
takes the worst position of every sequence.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from engine.model.config import ModelConfig
from engine.model.weights import Weights
from engine.run import reference
from engine.run.reference import LayerStates, forward, forward_segment, lm_head
from engine.testing.hf import to_hf_model

TINY = ModelConfig(
    vocab_size=512,
    hidden_size=64,
    num_layers=8,  # GDN 0-2, 4-6; attention 3, 7
    intermediate_size=96,
    num_attention_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rope_dims=8,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    full_attention_interval=4,
    linear_num_key_heads=2,
    linear_num_value_heads=6,
    linear_key_head_dim=16,
    linear_value_head_dim=12,
    conv_kernel=4,
    tied_embeddings=False,
    context_length=4096,
    rope_sections=(1, 1, 2, 0),
)


def random_weights(config: ModelConfig, seed: int) -> Weights:
    """Canonical weights with unit-scale activations: linear rows ~ N(0, 1/fan_in), norms near 1."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def linear(out: int, inp: int) -> torch.Tensor:
        return normal(out, inp, std=inp**-0.5)

    def norm(n: int) -> torch.Tensor:
        return 1.0 + normal(n, std=0.2)

    c = config
    hidden, inter, hd = c.hidden_size, c.intermediate_size, c.head_dim
    layers = []
    for i in range(c.num_layers):
        layer = {
            "attn_norm": norm(hidden),
            "post_attention_norm": norm(hidden),
            "ffn_gate": linear(inter, hidden),
            "ffn_up": linear(inter, hidden),
            "ffn_down": linear(hidden, inter),
        }
        if c.is_full_attention(i):
            layer |= {
                "attn_q": linear(2 * c.num_attention_heads * hd, hidden),
                "attn_k": linear(c.num_kv_heads * hd, hidden),
                "attn_v": linear(c.num_kv_heads * hd, hidden),
                "attn_output": linear(hidden, c.num_attention_heads * hd),
                "attn_q_norm": norm(hd),
                "attn_k_norm": norm(hd),
            }
        else:
            nv = c.linear_num_value_heads
            # decay rates spread over (0.05, 4): some heads remember long, some forget fast
            a = torch.exp(torch.empty(nv).uniform_(math.log(0.05), math.log(4.0), generator=gen))
            layer |= {
                "attn_qkv": linear(c.conv_dim, hidden),
                "attn_gate": linear(c.linear_value_dim, hidden),
                "ssm_beta": linear(nv, hidden),
                "ssm_alpha": linear(nv, hidden),
                "ssm_conv1d": normal(c.conv_dim, c.conv_kernel, std=0.5),
                "ssm_dt": normal(nv, std=0.5),
                "ssm_a": -a,
                "ssm_norm": norm(c.linear_value_head_dim),
                "ssm_out": linear(hidden, c.linear_value_dim),
            }
        layers.append(layer)
    token_embd = normal(c.vocab_size, hidden)
    output = token_embd if c.tied_embeddings else linear(c.vocab_size, hidden)
    return Weights(config=c, token_embd=token_embd, output_norm=norm(hidden), output=output, layers=layers)


def max_rel_err_per_position(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per position: max over the vocab of |ours - ref|, divided by max |ref| at that position."""
    ours, ref = ours.double(), ref.double()
    return (ours - ref).abs().amax(-1) / ref.abs().amax(-1)


@pytest.fixture(scope="module")
def weights() -> Weights:
    return random_weights(TINY, seed=0)


@pytest.fixture(scope="module")
def hf_model(weights: Weights):
    return to_hf_model(weights)


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids[None], use_cache=False).logits[0]


def test_matches_hf_on_random_sequences(weights: Weights, hf_model) -> None:
    gen = torch.Generator().manual_seed(1)
    lengths = [1, 2, 3, 5, 17, 63, 64, 65, 130, 512] + torch.randint(4, 513, (10,), generator=gen).tolist()
    worst = []
    for n in lengths:
        ids = torch.randint(0, TINY.vocab_size, (n,), generator=gen)
        ours = forward(weights, ids)
        assert ours.shape == (n, TINY.vocab_size) and ours.dtype == torch.float32
        err = max_rel_err_per_position(ours, hf_logits(hf_model, ids))
        worst.append(err.max().item())
    assert max(worst) <= 1e-4, f"worst per-position relative error {max(worst):.3e} (by sequence: {worst})"


def test_matches_hf_with_tied_embeddings_and_equal_heads() -> None:
    config = dataclasses.replace(TINY, tied_embeddings=True, linear_num_value_heads=2, num_layers=4)
    weights = random_weights(config, seed=2)
    assert weights.output is weights.token_embd
    model = to_hf_model(weights)
    ids = torch.randint(0, config.vocab_size, (200,), generator=torch.Generator().manual_seed(3))
    err = max_rel_err_per_position(forward(weights, ids), hf_logits(model, ids))
    assert err.max().item() <= 1e-4


def test_fp32_matches_fp64_oracle(weights: Weights) -> None:
    ids = torch.randint(0, TINY.vocab_size, (300,), generator=torch.Generator().manual_seed(4))
    f32 = forward(weights, ids)
    f64 = forward_segment(weights, ids, dtype=torch.float64)[0]
    assert f64.dtype == torch.float64
    assert max_rel_err_per_position(f32, f64).max().item() <= 2e-5


@pytest.mark.parametrize("splits", [[1], [40], [100, 1], [7, 64, 3], [1, 1, 1, 1]])
def test_prefix_then_suffix_equals_whole(weights: Weights, splits: list[int]) -> None:
    ids = torch.randint(0, TINY.vocab_size, (150,), generator=torch.Generator().manual_seed(5))
    whole, whole_state = forward_segment(weights, ids, dtype=torch.float64)

    bounds = [0] + [sum(splits[: i + 1]) for i in range(len(splits))] + [ids.numel()]
    state, parts = None, []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        out, state = forward_segment(weights, ids[lo:hi], state, lo, dtype=torch.float64)
        parts.append(out)
    pieced = torch.cat(parts)
    assert state.length == ids.numel()
    assert max_rel_err_per_position(pieced, whole).max().item() <= 1e-12
    for i in TINY.linear_attention_layers:
        torch.testing.assert_close(state.recurrent[i], whole_state.recurrent[i], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(state.conv[i], whole_state.conv[i], rtol=1e-12, atol=1e-12)
    for i in TINY.full_attention_layers:
        torch.testing.assert_close(state.keys[i], whole_state.keys[i], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(state.values[i], whole_state.values[i], rtol=1e-12, atol=1e-12)


def test_prefix_then_suffix_fp32(weights: Weights) -> None:
    ids = torch.randint(0, TINY.vocab_size, (120,), generator=torch.Generator().manual_seed(6))
    whole = forward(weights, ids)
    _, state = forward_segment(weights, ids[:50])
    suffix, _ = forward_segment(weights, ids[50:], state)
    assert max_rel_err_per_position(suffix, whole[50:]).max().item() <= 1e-5


def test_branching_from_one_state_leaves_it_unchanged(weights: Weights) -> None:
    ids = torch.randint(0, TINY.vocab_size, (80,), generator=torch.Generator().manual_seed(7))
    _, root = forward_segment(weights, ids[:30])
    snapshot = {
        f: {k: v.clone() for k, v in getattr(root, f).items()}
        for f in ("recurrent", "conv", "keys", "values")
    }
    a, _ = forward_segment(weights, ids[30:60], root)
    b, _ = forward_segment(weights, ids[60:], root)
    for f, saved in snapshot.items():
        for k, v in saved.items():
            assert torch.equal(getattr(root, f)[k], v)
    assert max_rel_err_per_position(a, forward(weights, ids[:60])[30:]).max().item() <= 1e-5
    branch_b = torch.cat([ids[:30], ids[60:]])
    assert max_rel_err_per_position(b, forward(weights, branch_b)[30:]).max().item() <= 1e-5


def test_selected_positions_and_rows_are_slices_of_full_logits(weights: Weights) -> None:
    ids = torch.randint(0, TINY.vocab_size, (90,), generator=torch.Generator().manual_seed(8))
    full = forward(weights, ids)
    positions = [89, 0, 41, 41]
    rows = torch.randperm(TINY.vocab_size, generator=torch.Generator().manual_seed(9))[:26]
    torch.testing.assert_close(
        forward(weights, ids, positions=positions), full[positions], rtol=1e-6, atol=1e-6
    )
    picked = forward(weights, ids, positions=positions, rows=rows)
    assert picked.shape == (4, 26)
    torch.testing.assert_close(picked, full[positions][:, rows], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(forward(weights, ids, rows=rows), full[:, rows], rtol=1e-6, atol=1e-6)


def test_hidden_output_feeds_lm_head(weights: Weights) -> None:
    ids = torch.randint(0, TINY.vocab_size, (40,), generator=torch.Generator().manual_seed(10))
    hidden, _ = forward_segment(weights, ids, output="hidden")
    assert hidden.shape == (40, TINY.hidden_size)
    # final-normed: rms of hidden / output_norm is 1 per position
    unscaled = hidden / weights.output_norm
    torch.testing.assert_close(unscaled.pow(2).mean(-1), torch.ones(40), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lm_head(weights, hidden), forward(weights, ids), rtol=1e-6, atol=1e-6)


def test_gated_delta_rule_single_step_by_hand() -> None:
    # one head, dk=2, dv=1, from S0: S1 = e^g S0 + k * beta (v - (e^g S0)^T k), o = S1^T q
    s0 = torch.tensor([[[1.0], [2.0]]], dtype=torch.float64)
    q = torch.tensor([[[0.5, -1.0]]], dtype=torch.float64)
    k = torch.tensor([[[0.6, 0.8]]], dtype=torch.float64)
    v = torch.tensor([[[3.0]]], dtype=torch.float64)
    g = torch.tensor([[math.log(0.5)]], dtype=torch.float64)
    beta = torch.tensor([[0.25]], dtype=torch.float64)
    o, s1 = reference.gated_delta_rule(q, k, v, g, beta, s0)
    decayed = [0.5, 1.0]
    err = 3.0 - (decayed[0] * 0.6 + decayed[1] * 0.8)  # 3 - 1.1 = 1.9
    expected = [decayed[0] + 0.6 * 0.25 * err, decayed[1] + 0.8 * 0.25 * err]
    torch.testing.assert_close(s1[0, :, 0], torch.tensor(expected, dtype=torch.float64))
    torch.testing.assert_close(o[0, 0, 0], torch.tensor(0.5 * expected[0] - expected[1], dtype=torch.float64))


def test_causal_conv_continues_across_segments() -> None:
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(10, 3, generator=gen, dtype=torch.float64)
    w = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    whole, tail = reference.causal_conv(x, torch.zeros(3, 3, dtype=torch.float64), w)
    # by hand: out[t, c] = sum_j w[c, j] * x[t - 3 + j, c], zero before the start
    padded = torch.cat([torch.zeros(3, 3, dtype=torch.float64), x])
    by_hand = torch.stack([(padded[t : t + 4].T * w).sum(-1) for t in range(10)])
    torch.testing.assert_close(whole, by_hand)
    torch.testing.assert_close(tail, x[-3:].T)
    first, mid = reference.causal_conv(x[:2], torch.zeros(3, 3, dtype=torch.float64), w)
    second, _ = reference.causal_conv(x[2:], mid, w)
    torch.testing.assert_close(torch.cat([first, second]), whole)


def test_bad_input_is_named(weights: Weights) -> None:
    with pytest.raises(ValueError, match="token_ids contains 512"):
        forward(weights, [1, 512])
    with pytest.raises(ValueError, match="token_ids is empty"):
        forward(weights, [])
    with pytest.raises(ValueError, match="positions contains 5"):
        forward(weights, [1, 2], positions=[5])
    with pytest.raises(ValueError, match="rows contains -1"):
        forward(weights, [1, 2], rows=[-1])
    with pytest.raises(ValueError, match="start_pos 3"):
        forward_segment(weights, [1, 2], LayerStates.empty(TINY), 3)
    with pytest.raises(ValueError, match="not a state of this model"):
        forward_segment(weights, [1], LayerStates(), 0)


def test_low_precision_keeps_fp32_recurrence(weights: Weights) -> None:
    ids = torch.randint(0, TINY.vocab_size, (20,), generator=torch.Generator().manual_seed(12))
    logits, state = forward_segment(weights, ids, dtype=torch.bfloat16)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    assert all(s.dtype == torch.float32 for s in state.recurrent.values())
    assert all(k.dtype == torch.bfloat16 for k in state.keys.values())
    assert forward(weights, ids, dtype=torch.bfloat16).dtype == torch.float32
