"""Tests for orchestrator.engine.rejection_sampler (cases adapted from vLLM's test_rejection_sampler.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from scipy import stats

from orchestrator.engine.rejection_sampler import RejectionSampler, proposal_lengths

# CPU always; CUDA too where present (the device check), with CUDA generators and RNG.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
on_devices = pytest.mark.parametrize("device", DEVICES)

# --- helpers -------------------------------------------------------------------------------


def one_hot(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[..] long (-1 allowed: an all-zero row) -> [.., V] float32 point masses."""
    return F.one_hot(ids.clamp(min=0), vocab).float() * (ids >= 0).unsqueeze(-1)


def random_probs(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.softmax(torch.randn(*shape, generator=gen) * 2, dim=-1)


def check_format(out: torch.Tensor, draft: torch.Tensor, bonus: torch.Tensor, vocab: int) -> None:
    """Each row: a prefix of its proposal, one more token in [0, V), then -1."""
    n, _ = proposal_lengths(draft)
    B, k = draft.shape
    assert out.shape == (B, k + 1) and out.dtype == torch.long
    for i in range(B):
        emitted = int((out[i] != -1).sum())
        assert 1 <= emitted <= int(n[i]) + 1
        assert (out[i, emitted:] == -1).all()
        assert torch.equal(out[i, :emitted - 1], draft[i, :emitted - 1])
        assert 0 <= int(out[i, emitted - 1]) < vocab
        if emitted == int(n[i]) + 1:
            assert out[i, emitted - 1] == bonus[i, 0]


# --- output format with point masses (exact) -------------------------------------------------

V = 10
DRAFT = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
BONUS = torch.tensor([[0], [1], [2]])


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft_probs", "no_draft_probs"])
@pytest.mark.parametrize("case", ["all", "none", "some"])
@on_devices
def test_output_format(case: str, point_mass: bool, device: str) -> None:
    # Point masses make every decision certain: p(x)=1 always accepts (u < 1), p(x)=0 never does.
    last = {"all": [3, 3, 3], "none": [0, 0, 0], "some": [0, 1, 2]}[case]  # accepted prefix len
    other = (DRAFT + 1) % V  # a token != the draft token
    target_ids = torch.stack([torch.where(torch.arange(3) < a, DRAFT[i], other[i])
                              for i, a in enumerate(last)])
    sampler = RejectionSampler(strict_mode=True)
    out, _ = sampler(one_hot(target_ids, V).to(device), BONUS.to(device),
                     None if point_mass else one_hot(DRAFT, V).to(device), DRAFT.to(device))
    expected = torch.full((3, 4), -1)
    for i, a in enumerate(last):
        expected[i, :a] = DRAFT[i, :a]
        # all accepted: the bonus; else the recovered token, the only mass of max(0, p - q)
        expected[i, a] = BONUS[i, 0] if a == 3 else other[i, a]
    assert torch.equal(out.cpu(), expected)


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft_probs", "no_draft_probs"])
@on_devices
def test_ragged_rows(point_mass: bool, device: str) -> None:
    draft = torch.tensor([[1, 2, 3], [4, 5, -1], [7, -1, -1], [3, 3, -1]])
    bonus = torch.tensor([[0], [1], [2], [9]])
    target_ids = draft.clone()
    target_ids[3, 1] = 6  # row 3 rejects its second proposal
    target = one_hot(target_ids, V)  # zero rows where not proposed, as the scorer sends them
    draft_probs = None if point_mass else one_hot(draft, V).to(device)
    out, _ = RejectionSampler(strict_mode=True)(target.to(device), bonus.to(device), draft_probs,
                                                draft.to(device))
    assert out.tolist() == [[1, 2, 3, 0], [4, 5, 1, -1], [7, 2, -1, -1], [3, 6, -1, -1]]


# --- no crash over sizes ---------------------------------------------------------------------

SIZES = [(b, k, v) for b in (1, 8, 32) for k in (1, 3, 6) for v in (30, 1000)]
SIZES += [(b, k, 32000) for b in (1, 2) for k in (1, 3, 6)]  # large vocab: small batches
SIZES = [(*size, "cpu") for size in SIZES]
if torch.cuda.is_available():
    SIZES += [(b, k, v, "cuda") for b in (1, 32) for k in (1, 6) for v in (30, 32000)]


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft_probs", "no_draft_probs"])
@pytest.mark.parametrize("batch,k,vocab,device", SIZES)
def test_no_crash_with_varying_dims(batch: int, k: int, vocab: int, point_mass: bool,
                                    device: str) -> None:
    gen = torch.Generator().manual_seed(batch * 1000 + k * 10 + vocab)
    target = random_probs(batch, k, vocab, gen=gen)
    draft_probs = None if point_mass else random_probs(batch, k, vocab, gen=gen)
    draft = torch.randint(0, vocab, (batch, k), generator=gen)
    lens = torch.randint(1, k + 1, (batch,), generator=gen)  # ragged, each row >= 1
    draft[torch.arange(k) >= lens.unsqueeze(1)] = -1
    bonus = torch.randint(0, vocab, (batch, 1), generator=gen)
    out, _ = RejectionSampler(strict_mode=True)(
        target.to(device), bonus.to(device),
        None if draft_probs is None else draft_probs.to(device), draft.to(device))
    check_format(out.cpu(), draft, bonus, vocab)


# --- seeded determinism ----------------------------------------------------------------------


def _batch(batch: int, k: int, vocab: int, seed: int, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    return (random_probs(batch, k, vocab, gen=gen).to(device),
            torch.randint(0, vocab, (batch, 1), generator=gen).to(device),
            random_probs(batch, k, vocab, gen=gen).to(device),
            torch.randint(0, vocab, (batch, k), generator=gen).to(device))


def _gen(seed: int, device: str) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _gens(*seeds: int, device: str = "cpu") -> list[torch.Generator]:
    return [_gen(s, device) for s in seeds]


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft_probs", "no_draft_probs"])
@on_devices
def test_deterministic_when_seeded(point_mass: bool, device: str) -> None:
    target, bonus, draft_probs, draft = _batch(16, 4, 50, seed=1, device=device)
    draft_probs = None if point_mass else draft_probs
    sampler = RejectionSampler()
    gens = lambda: _gens(*range(16), device=device)  # noqa: E731
    runs = [sampler(target, bonus, draft_probs, draft, generators=gens())[0] for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    # Not constant: other seeds give other outputs (the random vocab makes rejections common).
    other, _ = sampler(target, bonus, draft_probs, draft,
                       generators=_gens(*range(100, 116), device=device))
    assert not torch.equal(runs[0], other)


@on_devices
def test_seeded_row_independent_of_batch_mates(device: str) -> None:
    vocab = 50
    target, bonus, draft_probs, draft = _batch(1, 3, vocab, seed=2, device=device)
    draft[0, 2] = -1  # the seeded row proposes 2 of 3
    sampler = RejectionSampler(strict_mode=True)
    alone = [sampler(target, bonus, draft_probs, draft,
                     generators=_gens(seed, device=device))[0] for seed in range(20)]
    # The same row in a wider batch (k = 5, padded with -1) among unseeded and seeded mates.
    mates_t, mates_b, mates_q, mates_d = _batch(3, 5, vocab, seed=3, device=device)
    pad = torch.zeros(1, 2, vocab, device=device)
    big_t = torch.cat([mates_t[:1], torch.cat([target, pad], 1), mates_t[1:]])
    big_q = torch.cat([mates_q[:1], torch.cat([draft_probs, pad], 1), mates_q[1:]])
    big_d = torch.cat([mates_d[:1], F.pad(draft, (0, 2), value=-1), mates_d[1:]])
    big_b = torch.cat([mates_b[:1], bonus, mates_b[1:]])
    for seed in range(20):
        gens = [None, _gen(seed, device), None, _gen(7, device)]
        together, _ = sampler(big_t, big_b, big_q, big_d, generators=gens)
        assert together[1, :4].tolist() == alone[seed][0].tolist()
        assert (together[1, 4:] == -1).all()
    # 20 seeds must not all give the same output, or the check above proves nothing.
    assert len({tuple(a[0].tolist()) for a in alone}) > 1


@on_devices
def test_only_unseeded_rows_draw_from_the_global_rng(device: str) -> None:
    """As in vLLM: seeded batch mates take nothing from the global stream, so an unseeded row
    draws the same with or without them and the stream is left where it would be without them."""
    vocab = 50
    target, bonus, draft_probs, draft = _batch(3, 4, vocab, seed=4, device=device)
    sampler = RejectionSampler(strict_mode=True)

    def run(rows: list[int], gens: list) -> tuple[list[int], torch.Tensor]:
        torch.manual_seed(123)
        out, _ = sampler(target[rows], bonus[rows], draft_probs[rows], draft[rows],
                         generators=gens)
        return out[0].tolist(), torch.rand(8, device=device)

    alone, stream_alone = run([0], [None])
    mixed, stream_mixed = run([0, 1, 2], [None, _gen(1, device), _gen(2, device)])
    assert mixed == alone
    assert torch.equal(stream_mixed, stream_alone)


# --- distribution ----------------------------------------------------------------------------
#
# Rows are independent draws: each row samples its draft tokens from q and its bonus from the
# target's bonus distribution, and the sampler must turn that into tokens distributed as p.
# The target here is position-wise independent of the prefix (p_j does not depend on tokens
# before j), so the token emitted at position j, given that position j was reached, follows p_j.


def simulate(p: torch.Tensor, q: torch.Tensor, p_bonus: torch.Tensor, n: int, seed: int,
             pass_draft_probs: bool = True, device: str = "cpu") -> torch.Tensor:
    """n independent rows through the sampler; returns [n, k+1].

    p, q [k, V]: target and draft distribution at each position; p_bonus [V]. Draft tokens are
    drawn from q. With pass_draft_probs=False the sampler gets no q and treats each draft token
    as a point mass; that is lossless for any proposer too: P(y) = q(y) p(y) (accepted) +
    sum_{x != y} q(x) (1 - p(x)) p(y) / (1 - p(x)) (rejected, resampled) = p(y).
    """
    torch.manual_seed(seed)
    k, vocab = p.shape
    draft = torch.stack([torch.multinomial(q[j], n, replacement=True) for j in range(k)], 1)
    bonus = torch.multinomial(p_bonus, n, replacement=True).unsqueeze(1)
    draft_probs = q.expand(n, k, vocab).to(device) if pass_draft_probs else None
    out, _ = RejectionSampler()(p.expand(n, k, vocab).to(device), bonus.to(device), draft_probs,
                                draft.to(device))
    return out.cpu()


# alpha = 1e-3: a correct sampler fails one such test with probability 1e-3; the seeds are fixed,
# so a run is deterministic and a pass is stable. The wrong samplers below are rejected with
# p-values many orders of magnitude smaller, so alpha does not decide whether bugs are caught.
ALPHA = 1e-3
# Expected counts per cell stay >= 5, the usual validity condition of the test: V = 8, the
# smallest cell probability is >= 0.4 * 0.017 (see _dist and the peaked case), and >= 5000 rows
# reach each position checked: >= 34 expected per cell.
N = 40_000
VOCAB = 8


def chisquare_pvalue(samples: torch.Tensor, p: torch.Tensor) -> float:
    """Goodness-of-fit p-value of token samples [m] against distribution p [V]."""
    counts = torch.bincount(samples, minlength=p.numel()).double()
    expected = p.double() / p.double().sum() * counts.sum()
    return float(stats.chisquare(counts.numpy(), expected.numpy()).pvalue)


def _dist(*shape: int, seed: int) -> torch.Tensor:
    """Random distributions over V tokens, each probability >= 0.02 / (1 + 0.02 V) (0.017 at
    V = 8), which keeps the chi-square expected counts large."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(*shape, generator=gen), -1) + 0.02
    return probs / probs.sum(-1, keepdim=True)


def assert_follows_target(out: torch.Tensor, p: torch.Tensor, p_bonus: torch.Tensor) -> None:
    """Position j's token, among rows that reached j, follows p_j; the bonus position p_bonus."""
    k = p.shape[0]
    targets = [*p, p_bonus]
    for j in range(k + 1):
        reached = out[:, j] != -1
        assert reached.sum() >= 5_000, "too few rows reach this position for the test to mean much"
        pvalue = chisquare_pvalue(out[reached, j], targets[j])
        assert pvalue > ALPHA, f"position {j}: p-value {pvalue:.2e}"


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("same", [False, True], ids=["draft_ne_target", "draft_eq_target"])
@on_devices
def test_chisquare_matches_target(k: int, same: bool, device: str) -> None:
    p = _dist(k, VOCAB, seed=10 + k)
    q = p.clone() if same else _dist(k, VOCAB, seed=20 + k)
    p_bonus = _dist(VOCAB, seed=30 + k)
    out = simulate(p, q, p_bonus, N, seed=40 + k, device=device)
    if same:  # q == p: every proposal is accepted (u * q < p holds for u < 1)
        assert (out != -1).all()
    assert_follows_target(out, p, p_bonus)


@pytest.mark.parametrize("k", [1, 2])
@on_devices
def test_chisquare_matches_target_point_mass(k: int, device: str) -> None:
    # Point-mass acceptance is sum_x q(x) p(x), only ~1/V for flat distributions; peaked ones,
    # like a language model's, sharing their top token (0 here) make positions 1, 2 reachable.
    peak = F.one_hot(torch.zeros(k, dtype=torch.long), VOCAB).float()
    p = 0.6 * peak + 0.4 * _dist(k, VOCAB, seed=50 + k)
    q = 0.6 * peak + 0.4 * _dist(k, VOCAB, seed=55 + k)
    p_bonus = _dist(VOCAB, seed=60 + k)
    out = simulate(p, q, p_bonus, N, seed=70 + k, pass_draft_probs=False, device=device)
    assert_follows_target(out, p, p_bonus)


def test_chisquare_rejects_wrong_samplers() -> None:
    """The helper must be able to fail: two classic bugs give visibly wrong distributions."""
    p, q = _dist(1, VOCAB, seed=80), _dist(1, VOCAB, seed=81)
    torch.manual_seed(82)
    x = torch.multinomial(q[0], N, replacement=True)
    # 1. Always accept: the output follows q, not p.
    assert chisquare_pvalue(x, p[0]) < 1e-12
    # 2. On rejection, resample from p instead of max(0, p - q): biased towards p's overlap with q.
    accept = torch.rand(N) * q[0, x] < p[0, x]
    wrong = torch.where(accept, x, torch.multinomial(p[0], N, replacement=True))
    assert chisquare_pvalue(wrong, p[0]) < 1e-12
    # And the correct sampler on the same p, q passes (the helper is not simply always failing).
    out = simulate(p, q, p[0], N, seed=83)
    assert chisquare_pvalue(out[:, 0], p[0]) > ALPHA


def test_l2_distance_approaches_target() -> None:
    """vLLM's check: the empirical first-token distribution gets closer to p as N grows, and at
    the largest N it is much closer to p than random distributions are."""
    vocab = 10
    p, q = _dist(1, vocab, seed=90), _dist(1, vocab, seed=91)
    sizes = [100, 1_000, 10_000, 100_000]
    dists = []
    for i, n in enumerate(sizes):
        out = simulate(p, q, p[0], n, seed=92 + i)
        empirical = torch.bincount(out[:, 0], minlength=vocab).double() / n
        dists.append(float((empirical - p[0].double()).norm()))
    # Expected L2 error shrinks as 1/sqrt(N), ~3.2x per step; sampling noise on each value is
    # well under that factor, so a strict decrease holds (and, with fixed seeds, is stable).
    assert all(a > b for a, b in zip(dists, dists[1:])), dists
    reference = [float((_dist(vocab, seed=s).double() - p[0].double()).norm()) for s in range(10)]
    # At N = 1e5 the expected error is sqrt(sum p(1-p) / N) < 0.0032; random distributions on 10
    # tokens sit ~0.1 or more from p. Requiring 10x closer leaves a wide margin on both sides.
    assert dists[-1] * 10 < min(reference), (dists[-1], min(reference))


# --- greedy ----------------------------------------------------------------------------------


@on_devices
def test_greedy_exact(device: str) -> None:
    draft = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [4, 5, -1], [6, -1, -1], [7, 8, -1]])
    target = torch.tensor([
        [1, 2, 3, 9],  # all accepted: bonus 9
        [1, 0, 3, 9],  # mismatch at 1: emit target 0 (position 2 matches but is after it)
        [5, 2, 3, 9],  # mismatch at 0
        [4, 5, 8, -1],  # ragged, all accepted: bonus at position n_i = 2
        [6, 7, -1, -1],  # ragged n_i = 1, bonus 7
        [7, 1, 4, -1],  # ragged, mismatch at 1
    ])
    out, accepted = RejectionSampler(strict_mode=True).greedy(target.to(device),
                                                              draft.to(device))
    assert out.tolist() == [[1, 2, 3, 9], [1, 0, -1, -1], [5, -1, -1, -1], [4, 5, 8, -1],
                            [6, 7, -1, -1], [7, 1, -1, -1]]
    # Passed the accept test, even after a rejection (row 1: positions 0 and 2; row 2: 1, 2).
    assert accepted.tolist() == [3, 2, 2, 2, 1, 1]


# --- counters --------------------------------------------------------------------------------


@on_devices
def test_accepted_counts_per_row(device: str) -> None:
    """Each call returns, per row, the draft tokens that passed the accept test (vLLM 0.4.2's
    meaning: even after an earlier rejection); the sampler keeps nothing between calls."""
    sampler = RejectionSampler(strict_mode=True)
    draft = torch.tensor([[1, 2, 3], [4, 5, -1]])
    target_ids = torch.tensor([[0, 2, 3], [4, 5, -1]])  # row 0: position 0 rejected, 1 and 2 pass
    out, accepted = sampler(one_hot(target_ids, V).to(device),
                            torch.tensor([[7], [8]], device=device),
                            one_hot(draft, V).to(device), draft.to(device))
    assert out.tolist() == [[0, -1, -1, -1], [4, 5, 8, -1]]
    assert accepted.tolist() == [2, 2]
    assert accepted.dtype == torch.long
    out, accepted = sampler.greedy(
        torch.tensor([[1, 2, 0, 4, 6], [9, 9, 9, -1, -1]], device=device),
        torch.tensor([[1, 2, 3, 4], [5, 9, -1, -1]], device=device))
    assert out.tolist() == [[1, 2, 0, -1, -1], [9, -1, -1, -1, -1]]
    assert accepted.tolist() == [3, 1]  # row 0: 1, 2, 4; row 1: 9 at position 1
    assert vars(sampler) == {"strict_mode": True}  # no counters


# --- strict mode -----------------------------------------------------------------------------


def _good():
    draft = torch.tensor([[1, 2], [3, -1]])
    return dict(target_probs=one_hot(torch.tensor([[1, 2], [3, 4]]), 5),
                bonus_token_ids=torch.tensor([[0], [1]]),
                draft_probs=one_hot(torch.tensor([[1, 2], [3, 4]]), 5),
                draft_token_ids=draft)


def _with(**changes):
    args = _good()
    args.update(changes)
    return args


BAD_SAMPLE_INPUTS = {
    "target_probs_rank": (_with(target_probs=torch.zeros(2, 5)), "target_probs"),
    "target_probs_B": (_with(target_probs=one_hot(torch.tensor([[1, 2]]), 5)), "target_probs"),
    "target_probs_dtype": (_with(target_probs=torch.ones(2, 2, 5, dtype=torch.long)),
                           "target_probs"),
    "target_probs_range": (_with(target_probs=one_hot(torch.tensor([[1, 2], [3, 4]]), 5) * 2 - 0.5),
                           "target_probs"),
    "target_probs_sum": (_with(target_probs=torch.full((2, 2, 5), 0.1)), "target_probs"),
    "draft_probs_V": (_with(draft_probs=torch.full((2, 2, 4), 0.25)), "draft_probs"),
    "draft_probs_sum": (_with(draft_probs=torch.full((2, 2, 5), 0.3)), "draft_probs"),
    "draft_probs_nan": (_with(draft_probs=torch.full((2, 2, 5), float("nan"))), "draft_probs"),
    "draft_ids_dtype": (_with(draft_token_ids=torch.tensor([[1, 2], [3, -1]], dtype=torch.int32)),
                        "draft_token_ids"),
    "draft_ids_rank": (_with(draft_token_ids=torch.tensor([1, 2])), "draft_token_ids"),
    "draft_ids_range": (_with(draft_token_ids=torch.tensor([[1, 5], [3, -1]])), "draft_token_ids"),
    "draft_ids_negative": (_with(draft_token_ids=torch.tensor([[1, -2], [3, -1]])),
                           "draft_token_ids"),
    "draft_ids_hole": (_with(draft_token_ids=torch.tensor([[-1, 2], [3, -1]])), "draft_token_ids"),
    "draft_ids_empty_row": (_with(draft_token_ids=torch.tensor([[1, 2], [-1, -1]])),
                            "draft_token_ids"),
    "bonus_shape": (_with(bonus_token_ids=torch.tensor([0, 1])), "bonus_token_ids"),
    "bonus_dtype": (_with(bonus_token_ids=torch.tensor([[0], [1]], dtype=torch.int32)),
                    "bonus_token_ids"),
    "bonus_range": (_with(bonus_token_ids=torch.tensor([[0], [5]])), "bonus_token_ids"),
    "generators_len": (_with(generators=[None]), "generators"),
}


def test_strict_good_input_passes() -> None:
    out, _ = RejectionSampler(strict_mode=True)(**_good())
    assert out.tolist() == [[1, 2, 0], [3, 1, -1]]


@pytest.mark.parametrize("case", list(BAD_SAMPLE_INPUTS))
def test_strict_mode_rejects(case: str) -> None:
    args, name = BAD_SAMPLE_INPUTS[case]
    with pytest.raises(ValueError, match=f"^{name}:"):
        RejectionSampler(strict_mode=True)(**args)


@pytest.mark.parametrize("target,draft,name", [
    (torch.tensor([[1, 2]]), torch.tensor([[1, 2]]), "target_token_ids"),  # not [B, k+1]
    (torch.tensor([[1, 2, 3]], dtype=torch.int32), torch.tensor([[1, 2]]), "target_token_ids"),
    (torch.tensor([[1, -1, 3]]), torch.tensor([[1, 2]]), "target_token_ids"),  # unscored
    (torch.tensor([[1, 2, 3]]), torch.tensor([[-1, 2]]), "draft_token_ids"),  # hole
    (torch.tensor([[1, 2, 3]]), torch.tensor([[-1, -1]]), "draft_token_ids"),  # n_i = 0
    (torch.tensor([[1, 2, 3]]), torch.tensor([[1, -3]]), "draft_token_ids"),  # negative
])
def test_strict_mode_rejects_greedy(target, draft, name) -> None:
    with pytest.raises(ValueError, match=f"^{name}:"):
        RejectionSampler(strict_mode=True).greedy(target, draft)


def test_non_strict_accepts_empty_row() -> None:
    """Documented: without strict mode an n_i = 0 row just emits its bonus token."""
    args = _with(draft_token_ids=torch.tensor([[1, 2], [-1, -1]]))
    out, accepted = RejectionSampler()(**args)
    assert out.tolist() == [[1, 2, 0], [1, -1, -1]]
    assert accepted.tolist() == [2, 0]
