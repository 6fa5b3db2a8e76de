"""Letter read-out, coverage and rounds, against independent oracles (torch softmax, naive
float64 sums, a Luce-model scorer whose exact answer is known)."""

from __future__ import annotations

import math
import random
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.decide.readout import (
    GROUP_SIZE,
    MAX_LETTERS,
    ChoiceRounds,
    LetterReadout,
    _fold_flat,
    combine_rounds,
    coverage_from_logsumexp,
    fold_vocab_mass,
    letter_probabilities,
    mix_probabilities,
    plan_rounds,
    read_letters,
    read_letters_many,
    readout_from_letter_logits,
    run_choice_rounds,
    select_finalists,
    vocab_logsumexp,
)

VOCAB = 64
LETTER_IDS = list(range(10, 10 + MAX_LETTERS))  # stand-ins for the A..Z tokens

f32 = st.floats(-60.0, 60.0, allow_nan=False, width=32)
temperatures = st.floats(0.05, 20.0)
letter_logit_lists = st.lists(f32, min_size=1, max_size=MAX_LETTERS)


def first_argmax(values) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))


def torch_softmax(logits, temperature) -> list[float]:
    return torch.softmax(torch.tensor(logits, dtype=torch.float64) / temperature, dim=0).tolist()


# ---- one read-out ----------------------------------------------------------------------------


@given(letter_logit_lists, temperatures)
def test_probabilities_sum_to_one_and_match_torch(logits, t):
    p = letter_probabilities(logits, t)
    assert abs(math.fsum(p) - 1.0) <= 1e-6
    assert all(0.0 <= x <= 1.0 for x in p)
    for ours, ref in zip(p, torch_softmax(logits, t), strict=True):
        assert ours == pytest.approx(ref, rel=1e-12, abs=1e-300)


@given(letter_logit_lists, temperatures)
def test_temperature_never_changes_argmax(logits, t):
    """Temperature keeps the order of the options (non-strictly: logits closer than the rounding
    of exp, such as -1e-38 and 0, may come out as equal probabilities)."""
    p = letter_probabilities(logits, t)
    assert p[first_argmax(logits)] == max(p)
    for i, j in zip(range(len(p)), range(1, len(p)), strict=False):
        if logits[i] >= logits[j]:
            assert p[i] >= p[j]
        else:
            assert p[i] <= p[j]


@given(letter_logit_lists, temperatures, st.randoms(use_true_random=False))
def test_permuting_logits_permutes_probabilities(logits, t, rnd):
    perm = list(range(len(logits)))
    rnd.shuffle(perm)
    p = letter_probabilities(logits, t)
    q = letter_probabilities([logits[i] for i in perm], t)
    # fsum makes the normaliser order-independent, so the permutation is exact.
    assert list(q) == [p[i] for i in perm]


@settings(max_examples=50)
@given(
    st.lists(f32, min_size=VOCAB, max_size=VOCAB),
    st.lists(st.sampled_from(range(VOCAB)), min_size=1, max_size=MAX_LETTERS, unique=True),
    temperatures,
)
def test_read_letters_keeps_raw_logits_and_matches_naive_coverage(vocab_logits, ids, t):
    logits = torch.tensor(vocab_logits, dtype=torch.float32)
    ro = read_letters(logits, ids, t)
    assert ro.letter_ids == tuple(ids)
    assert torch.equal(torch.tensor(ro.logits, dtype=torch.float32), logits[ids])
    assert ro.temperature == t
    assert list(ro.probabilities) == list(letter_probabilities(ro.logits, t))
    # naive oracle: plain float64 sums (values are bounded, so no overflow here)
    mass = [math.exp(x) for x in vocab_logits]
    expected = sum(mass[i] for i in ids) / sum(mass)
    assert ro.coverage == pytest.approx(expected, rel=1e-9, abs=1e-300)
    # the engine-side path (letter rows + a vocabulary logsumexp) agrees
    split = coverage_from_logsumexp(ro.logits, vocab_logsumexp(logits))
    assert split == pytest.approx(expected, rel=1e-9, abs=1e-300)


def test_coverage_half_the_mass():
    # letters 0 and 1 carry e^0 + e^0, the rest e^ln2 = 2 in one token: exactly half.
    logits = torch.tensor([0.0, 0.0, math.log(2.0), -math.inf], dtype=torch.float32)
    ro = read_letters(logits, [0, 1], 1.0)
    assert ro.coverage == pytest.approx(0.5, abs=1e-7)  # ln2 rounded to float32
    uniform = torch.zeros(10, dtype=torch.float32)
    assert read_letters(uniform, [1, 3, 5, 7, 9], 0.3).coverage == pytest.approx(0.5, abs=1e-15)


def test_coverage_is_stable_for_huge_logits():
    # exp(1000) overflows float64; a max-shifted logsumexp does not.
    logits = torch.full((8,), 1000.0, dtype=torch.float32)
    ro = read_letters(logits, [0, 1, 2, 3], 1.0)
    assert ro.coverage == pytest.approx(0.5, abs=1e-15)
    assert ro.probabilities == pytest.approx((0.25,) * 4, abs=1e-15)


def test_coverage_one_when_letters_are_the_whole_mass():
    logits = torch.tensor([3.0, 1.0, -math.inf, -math.inf])
    assert read_letters(logits, [0, 1], 2.0).coverage == 1.0
    assert read_letters(torch.tensor([0.5, -2.0]), [1, 0], 1.0).coverage == 1.0


def test_coverage_hand_computed():
    # letters e^1 + e^2, others 3·e^0: coverage = (e + e²) / (e + e² + 3)
    logits = torch.tensor([1.0, 2.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    e = math.e
    expected = (e + e * e) / (e + e * e + 3.0)
    assert read_letters(logits, [0, 1], 1.0).coverage == pytest.approx(expected, rel=1e-14)
    # temperature changes the letter softmax, never coverage (defined at temperature 1)
    assert read_letters(logits, [0, 1], 0.1).coverage == pytest.approx(expected, rel=1e-14)
    lse = math.log(e + e * e + 3.0)
    assert coverage_from_logsumexp([1.0, 2.0], lse) == pytest.approx(expected, rel=1e-14)


def test_coverage_can_be_skipped():
    assert read_letters(torch.zeros(4), [0, 1], 1.0, coverage=False).coverage is None


def test_integer_like_letter_ids():
    ro = read_letters(torch.arange(6.0), torch.tensor([5, 2]), 1.0)
    assert ro.letter_ids == (5, 2) and ro.logits == (5.0, 2.0)


def test_readout_top_and_dict():
    ro = read_letters(torch.tensor([0.0, 2.0, 2.0, -1.0]), [0, 1, 2], 1.0)
    assert ro.top == 1  # tie between B and C goes to the earlier
    assert ro.top_probability == ro.probabilities[1]
    d = ro.to_dict()
    assert d["letter_ids"] == [0, 1, 2] and d["logits"] == [0.0, 2.0, 2.0]
    assert d["probabilities"] == list(ro.probabilities)


@pytest.mark.parametrize(
    ("logits", "ids", "t", "message"),
    [
        (torch.zeros(8), [], 1.0, "empty"),
        (torch.zeros(8), [1, 2, 1], 1.0, "duplicate letter ids"),
        (torch.zeros(8), [1, 8], 1.0, "outside the vocabulary"),
        (torch.zeros(8), [-1], 1.0, "outside the vocabulary"),
        (torch.zeros(40), list(range(27)), 1.0, "at most 26"),
        (torch.zeros(8), [1, 2], 0.0, "temperature"),
        (torch.zeros(8), [1, 2], -1.0, "temperature"),
        (torch.zeros(8), [1, 2], float("nan"), "temperature"),
        (torch.zeros(8), [1, 2], float("inf"), "temperature"),
        (torch.tensor([0.0, float("nan"), 1.0]), [0, 2], 1.0, "NaN"),
        (torch.tensor([0.0, float("inf"), 1.0]), [0, 2], 1.0, r"\+inf"),
        (torch.tensor([0.0, -float("inf"), 1.0]), [0, 1], 1.0, "finite"),
        (torch.zeros(2, 4), [0, 1], 1.0, "1-D"),
        (torch.zeros(4, dtype=torch.int64), [0, 1], 1.0, "floating-point"),
        (torch.zeros(0), [0], 1.0, "empty"),
        (torch.zeros(8), [1, 2.0], 1.0, "integers"),
        (torch.zeros(8), [True, 2], 1.0, "integers"),
    ],
)
def test_read_letters_rejects_bad_input(logits, ids, t, message):
    with pytest.raises(ValueError, match=message):
        read_letters(logits, ids, t)


def test_read_letters_many_reads_each_row_as_read_letters_does():
    g = torch.Generator().manual_seed(7)
    block = torch.randn(4, 50, generator=g) * 3
    rows = [block[0], block[2], torch.randn(30, generator=g, dtype=torch.float64), block[3]]
    ids = [[5, 1, 40], [0], [29, 3], list(range(26))]
    temps = [1.0, 0.3, 2.5, 0.7]
    for coverage in (True, False):
        many = read_letters_many(rows, ids, temps, coverage=coverage)
        assert many == [
            read_letters(r, i, t, coverage=coverage) for r, i, t in zip(rows, ids, temps, strict=True)
        ]
    assert read_letters_many([], [], []) == []


def test_read_letters_many_checks_every_row_first():
    good = torch.zeros(8)
    with pytest.raises(ValueError, match="2 rows, 1 letter id lists and 2 temperatures"):
        read_letters_many([good, good], [[0]], [1.0, 1.0])
    with pytest.raises(ValueError, match="duplicate"):
        read_letters_many([good, good], [[0, 1], [2, 2]], [1.0, 1.0])
    with pytest.raises(ValueError, match="NaN"):
        read_letters_many([good, torch.tensor([0.0, float("nan")])], [[0], [0]], [1.0, 1.0])
    with pytest.raises(ValueError, match="temperature"):
        read_letters_many([good], [[0]], [0.0])


def test_letter_level_api_rejects_bad_input():
    with pytest.raises(ValueError, match="finite"):
        letter_probabilities([0.0, float("nan")], 1.0)
    with pytest.raises(ValueError, match="at least one"):
        letter_probabilities([], 1.0)
    with pytest.raises(ValueError, match="duplicate"):
        readout_from_letter_logits([3, 3], [0.0, 1.0], 1.0)
    with pytest.raises(ValueError, match="2 letter ids but 3"):
        readout_from_letter_logits([3, 4], [0.0, 1.0, 2.0], 1.0)


def test_mix_probabilities():
    a, b = (0.2, 0.8), (0.6, 0.4)
    assert mix_probabilities(a, b, 1.0) == b
    assert mix_probabilities(a, b, 0.0) == a
    assert mix_probabilities(a, b, 0.5) == pytest.approx((0.4, 0.6))
    assert math.fsum(mix_probabilities(a, b, 0.3)) == pytest.approx(1.0, abs=1e-12)
    with pytest.raises(ValueError, match="weight"):
        mix_probabilities(a, b, 1.5)
    with pytest.raises(ValueError, match="length"):
        mix_probabilities(a, (0.1, 0.2, 0.7), 0.5)
    with pytest.raises(ValueError, match="sum"):
        mix_probabilities(a, (0.1, 0.2), 0.5)


# ---- rounds ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 26, 27, 40, 50, 51, 52, 75, 200, 201, 226, 255])
def test_plan_rounds_partitions_in_order(n):
    groups = plan_rounds([f"o{i}" for i in range(n)])
    assert [i for g in groups for i in g] == list(range(n))
    if n <= MAX_LETTERS:
        assert groups == [list(range(n))]
    else:
        assert len(groups) == math.ceil(n / GROUP_SIZE)
        sizes = [len(g) for g in groups]
        assert max(sizes) <= GROUP_SIZE and max(sizes) - min(sizes) <= 1


def test_plan_rounds_rejects_bad_options():
    with pytest.raises(ValueError, match="empty"):
        plan_rounds([])
    with pytest.raises(ValueError, match="duplicate options"):
        plan_rounds(["a", "b", "a"])


class SyntheticScorer:
    """Builds a full-vocabulary logit vector per group: each option has a latent logit; with
    `noise`, a group-dependent perturbation makes the reads inconsistent with one another
    (not a Luce model), as real prompts are."""

    def __init__(self, n: int, seed: int, spread: float = 3.0, noise: float = 0.0, temperature: float = 1.0):
        rng = random.Random(seed)
        self.latent = [rng.gauss(0.0, spread) for _ in range(n)]
        self.noise, self.rng, self.temperature = noise, rng, temperature
        self.calls: list[list[list[int]]] = []

    def logits(self, group: list[int]) -> torch.Tensor:
        vocab = torch.full((VOCAB,), -4.0, dtype=torch.float32)
        for j, option in enumerate(group):
            vocab[LETTER_IDS[j]] = self.latent[option] + self.rng.gauss(0.0, self.noise)
        return vocab

    def __call__(self, groups: list[list[int]]) -> list[LetterReadout]:
        self.calls.append(groups)
        return [read_letters(self.logits(g), LETTER_IDS[: len(g)], self.temperature) for g in groups]


@pytest.mark.parametrize(("n", "stages"), [(2, 1), (26, 1), (27, 2), (40, 2), (200, 2), (201, 3), (255, 3)])
@pytest.mark.parametrize("noise", [0.0, 1.5])
def test_rounds_distribution_is_complete_and_consistent(n, stages, noise):
    scorer = SyntheticScorer(n, seed=n, noise=noise)
    rounds = run_choice_rounds(n, scorer)
    p = rounds.probabilities
    assert len(p) == n and len(rounds.stages) == stages
    assert all(x > 0.0 for x in p)
    assert abs(math.fsum(p) - 1.0) <= 1e-6
    for stage in rounds.stages[:-1]:
        assert all(len(g) <= GROUP_SIZE for g in stage.groups)
    final = rounds.stages[-1]
    assert final.final and len(final.groups) == 1 and len(final.groups[0]) <= MAX_LETTERS
    # the overall argmax (ties → display order) is the final round's argmax
    assert first_argmax(p) == rounds.final_choice == final.groups[0][final.readouts[0].top]


@pytest.mark.parametrize("n", [40, 255])
def test_rounds_recover_the_full_softmax_under_a_luce_model(n):
    # Context-free logits make every read a Luce choice; the combination is then exact.
    scorer = SyntheticScorer(n, seed=7 * n, noise=0.0, temperature=0.7)
    p = run_choice_rounds(n, scorer).probabilities
    exact = torch_softmax([float(torch.tensor(x, dtype=torch.float32)) for x in scorer.latent], 0.7)
    assert p == pytest.approx(exact, rel=1e-9)


@pytest.mark.parametrize("n", [40, 255])
def test_uniform_scorer_gives_uniform_rounds(n):
    rounds = run_choice_rounds(
        n, lambda groups: [read_letters(torch.zeros(VOCAB), LETTER_IDS[: len(g)], 1.0) for g in groups]
    )
    assert rounds.probabilities == pytest.approx([1.0 / n] * n, rel=1e-12)
    assert rounds.final_choice == 0


@settings(max_examples=40, deadline=None)
@given(st.integers(27, 255), st.integers(0, 10**6), st.floats(0.0, 4.0), st.floats(0.2, 3.0))
def test_rounds_keep_group_order(n, seed, noise, t):
    scorer = SyntheticScorer(n, seed=seed, spread=4.0, noise=noise, temperature=t)
    rounds = run_choice_rounds(n, scorer)
    p = rounds.probabilities
    assert all(x > 0.0 for x in p) and abs(math.fsum(p) - 1.0) <= 1e-6
    assert first_argmax(p) == rounds.final_choice
    first = rounds.stages[0]
    finalists = set(select_finalists(first.groups, [r.probabilities for r in first.readouts]))
    for group, ro in zip(first.groups, first.readouts, strict=True):
        tops = [o for o in group if o in finalists]
        rest = [(ro.probabilities[j], o) for j, o in enumerate(group) if o not in finalists]
        for o in (o for _, o in rest):
            assert all(p[o] < p[f] for f in tops)  # never above a finalist of its own group
        rest.sort()
        for (q1, o1), (q2, o2) in zip(rest, rest[1:], strict=False):
            assert p[o1] <= p[o2]  # group order kept among non-finalists
            if q1 == q2:
                assert p[o1] == p[o2]


def test_rounds_stay_positive_when_reads_underflow():
    # latent gaps of thousands at a low temperature underflow float64 inside every group
    n = 60
    latent = [-(i % 25) * 800.0 for i in range(n)]

    def read(groups):
        out = []
        for g in groups:
            vocab = torch.full((VOCAB,), -1e4)
            for j, o in enumerate(g):
                vocab[LETTER_IDS[j]] = latent[o]
            out.append(read_letters(vocab, LETTER_IDS[: len(g)], 0.5))
        return out

    rounds = run_choice_rounds(n, read)
    p = rounds.probabilities
    assert all(x > 0.0 for x in p) and abs(math.fsum(p) - 1.0) <= 1e-6
    assert first_argmax(p) == rounds.final_choice


def test_combine_rounds_hand_computed():
    # two groups of four; top 3 of each go on; the final over 6 finalists.
    g0, g1 = [0, 1, 2, 3], [4, 5, 6, 7]
    q0, q1 = [0.4, 0.3, 0.2, 0.1], [0.1, 0.5, 0.25, 0.15]
    assert select_finalists([g0, g1], [q0, q1]) == [0, 1, 2, 5, 6, 7]
    r = [0.3, 0.2, 0.1, 0.25, 0.1, 0.05]
    p = combine_rounds([g0, g1], [q0, q1], r)
    rho0 = min(0.3 / 0.4, 0.2 / 0.3, 0.1 / 0.2)  # 0.5
    rho1 = min(0.25 / 0.5, 0.1 / 0.25, 0.05 / 0.15)  # 1/3
    s = [0.3, 0.2, 0.1, rho0 * 0.1, rho1 * 0.1, 0.25, 0.1, 0.05]
    z = sum(s)
    assert z == pytest.approx(1 + rho0 * 0.1 + rho1 * 0.1)
    assert p == pytest.approx([x / z for x in s], rel=1e-15)


def test_combine_rounds_rejects_bad_input():
    g, q = [[0, 1, 2, 3], [4, 5]], [[0.4, 0.3, 0.2, 0.1], [0.5, 0.5]]
    with pytest.raises(ValueError, match="5 finalists but 4"):
        combine_rounds(g, q, [0.25] * 4)
    with pytest.raises(ValueError, match="sum"):
        combine_rounds(g, [[0.4, 0.3, 0.2, 0.2], [0.5, 0.5]], [0.2] * 5)
    with pytest.raises(ValueError, match="repeats"):
        combine_rounds([[0, 1], [1, 2]], [[0.5, 0.5], [0.5, 0.5]], [0.25] * 4)
    with pytest.raises(ValueError, match="2 options but 3"):
        combine_rounds([[0, 1]], [[0.2, 0.3, 0.5]], [0.5, 0.5])
    with pytest.raises(ValueError, match="no groups"):
        select_finalists([], [])


def test_choice_rounds_state_errors():
    rounds = ChoiceRounds(40)
    with pytest.raises(ValueError, match="not finished"):
        rounds.probabilities  # noqa: B018
    with pytest.raises(ValueError, match="expected 2 read-outs"):
        rounds.submit([])
    short = read_letters(torch.zeros(VOCAB), LETTER_IDS[:3], 1.0)
    with pytest.raises(ValueError, match="20 options but its read-out has 3"):
        rounds.submit([short, short])
    with pytest.raises(ValueError, match="positive int"):
        ChoiceRounds(0)
    done = run_choice_rounds(3, lambda gs: [read_letters(torch.zeros(VOCAB), LETTER_IDS[:3], 1.0)])
    with pytest.raises(ValueError, match="already"):
        done.submit([short])
    assert done.pending() == [] and done.probabilities == pytest.approx([1 / 3] * 3)


def test_the_flat_fold_is_fold_vocab_mass():
    """`_fold_flat` (a device read-out's chunks back to back, FIELDS a chunk) folds to the same
    numbers and refuses the same rows as `fold_vocab_mass` over a list per chunk."""
    g = torch.Generator().manual_seed(3)
    inf = float("inf")
    maxes, sums = (torch.randn(61, generator=g) * 9).tolist(), torch.rand(61, generator=g).tolist()
    rows = [
        [[m, s, 0.0, 0.0] for m, s in zip(maxes, sums, strict=True)],
        [[-inf, 0.0, 0.0, 0.0], [2.5, 1.75, 0.0, 0.0], [-inf, 0.0, 0.0, 0.0]],
        [[1.0, 1.0, 2.0, 0.0], [0.0, 1.0, 1.0, 0.0]],  # NaN entries
        [[1.0, 1.0, 0.0, 1.0]],  # +inf
        [[-inf, 0.0, 0.0, 0.0]] * 2,  # all -inf
    ]
    for chunks in rows:
        flat = [9.0, *(v for c in chunks for v in c), 9.0]  # read from the middle of a buffer
        try:
            want = fold_vocab_mass(chunks)
        except ValueError as e:
            with pytest.raises(ValueError, match=re.escape(str(e))):
                _fold_flat(flat, 1, len(flat) - 1)
            continue
        m = max(c[0] for c in chunks)  # the fold as written before it read flat buffers
        assert want == (m, math.fsum(c[1] * math.exp(c[0] - m) for c in chunks if c[0] != -inf))
        assert _fold_flat(flat, 1, len(flat) - 1) == want
