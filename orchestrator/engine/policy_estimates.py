"""What the speculation policy knows of a sequence and expects of a step: acceptance and
continuation estimates (decayed counts), and the distribution of proposal lengths that
prices a batch's verify by its longest proposal (docs/design.md, adaptive speculation).

With acceptance α₁ of a proposal's first token and α of each later one (given the ones
before it were accepted), and a draft that goes on after each proposal with probability c
(early stop), a sequence asking for k proposals emits on average

    E(α₁, α, k, c) = 1 + α₁ Σ_{j=1..k} (c α)^(j-1)

tokens (the accepted prefix plus the target's token). One α for every position (α₁ = α)
fits real text badly: a draft is wrong most often on the first token after the target's
own, and once right it stays right for a while. On two pinned hosts (Qwen 0.5B -> 1.5B,
bf16, async_bench) a Q&A prompt accepted 16 of 31 proposals at k = 2 (1.0 a step) and 20
of 42 at k = 4 (1.7 a step): one α (~0.5) predicts 0.9 a step at k = 4, α₁ ~ 0.55 and
α ~ 0.8 fit both. Its proposal length L has
P(L >= j) = c^(j-1) for 1 <= j <= k (an n-gram proposer: L = k when it finds a match, with
the sequence's match rate r, else 0). A batch's verify is as wide as its longest proposal
plus one: P(max_i L_i <= m) = Π_i P(L_i <= m).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specdecode.cost_model import ForwardCosts

DECAY = 0.8  # weight of a sequence's earlier evidence after each speculative step
IDLE_DECAY = 0.98  # ... after each step without a proposal (half-life ~34 steps)
GLOBAL_DECAY = 0.98  # the all-sequences prior, per speculative sequence-step
EXPLORE_FIRST = 8  # a sequence's plain steps before its first exploratory step
EXPLORE_MAX = 256  # the wait between a sequence's explorations doubles up to this
EXPLORE_SHARE = 0.02  # an exploration's predicted loss: at most this share of the plain time
EXPLORE_FIRST_SHARE = 0.03  # ... the first on a table's: of the plain time its requests have left
# ... or of the plain time decoded on unchecked tables so far, across requests, up to a share
# of what the requests have left (a table whose verify cells read 3x dear priced every first
# exploration of a 32-token request over its 3%: a stack serving short requests decoded
# plainly for good)
EXPLORE_UNCHECKED_SHARE, EXPLORE_REQUEST_CAP = 0.1, 0.25
EXPLORE_AT_ONCE_GAIN = 1.5  # after a fresh table, explore at a sequence's first decode step
# when the tables say fully accepted speculation would run this much faster, within
# EXPLORE_REQUEST_CAP of what its request has left (within 3%, fp32's first request on a
# fresh stack, priced at the start-up prior on the dear 3-token verify, waited 11 of its 32
# steps: 0.84x fixed k=8 on code)
PRIOR_WEIGHT = 2.0  # pseudo-trials of the prior in a sequence's estimate, at least ...
PRIOR_WEIGHT_MAX = 16.0  # ... and at most, as alike as ended sequences accepted (PriorWeight)
PRIOR_SEQS = 3  # ended sequences before their spread sets the weight ...
PRIOR_TRIED = 4.0  # ... each with this many (decayed) positions tested
LEARNED_WINDOW = 9  # a learned time or factor: the median of this many recent steps
FACTOR_RANGE = (0.05, 20.0)  # bounds on a learned cost factor (one wild sample)
LEARNED_TRUST = 3  # ... a cautious one believes a dearer reading from this many on
TRUST_START, TRUST_GROWTH = 2, 4  # k on a sequence's own evidence: 2, then 4x its accepted
REALIZED_DECAY = 0.9  # weight of earlier steps of a kind in Realized (about ten steps)
REALIZED_MIN = 3.0  # ... and the (decayed) steps it needs before it corrects a prediction


@dataclass(frozen=True)
class Rate:
    """A sequence's acceptance: of a proposal's first token, and of each later one given
    that the ones before it were accepted."""

    first: float
    rest: float

    @classmethod
    def of(cls, alpha: float | Rate) -> Rate:
        return alpha if isinstance(alpha, Rate) else cls(alpha, alpha)

    def all_accepted(self, n: float) -> float:
        """The chance that n proposals (an expected length: n may be fractional) are all
        accepted."""
        return 1.0 if n <= 0 else self.first * self.rest ** (n - 1)


def expected_tokens(alpha: float | Rate, k: int, cont: float = 1.0) -> float:
    """E(α₁, α, k, c): tokens one sequence emits from up to k proposals at acceptance
    `alpha` (a Rate, or one α for every position), when the draft goes on after each
    proposal with probability `cont` (early stop)."""
    if k <= 0:
        return 1.0
    a = Rate.of(alpha)
    r = cont * a.rest
    return 1.0 + a.first * (k if r >= 1.0 else (1.0 - r ** k) / (1.0 - r))


def length_pmf(k: int, cont: float = 1.0, rate: float = 1.0,
               draft_model: bool = True) -> list[float]:
    """[k+1]: P(L = j), the proposal length returned when asking for k. A draft model
    proposes at least one token and stops early after position j with probability
    1 - cont; an n-gram proposer proposes k with probability `rate` (a match), else 0."""
    if k <= 0:
        return [1.0]
    if not draft_model:
        return [1.0 - rate] + [0.0] * (k - 1) + [rate]
    return [0.0] + [cont ** (j - 1) * (1.0 - cont) for j in range(1, k)] + [cont ** (k - 1)]


def point_pmf(n: int) -> list[float]:
    """A proposal length known to be n (a step that ran)."""
    return [0.0] * n + [1.0]


def longest_pmf(pmfs: list[list[float]]) -> list[float]:
    """P(max_i L_i = m) for m = 0 .. the longest k: what a batch's verify width follows."""
    top = max(len(p) for p in pmfs)
    cdfs = []
    for p in pmfs:
        acc, cdf = 0.0, []
        for m in range(top):
            acc += p[m] if m < len(p) else 0.0
            cdf.append(min(acc, 1.0))
        cdfs.append(cdf)
    joint = [1.0] * top
    for cdf in cdfs:
        joint = [a * b for a, b in zip(joint, cdf)]
    return [joint[0]] + [joint[m] - joint[m - 1] for m in range(1, top)]


def longer_than(pmf: list[float], s: int) -> float:
    """P(L > s)."""
    return sum(pmf[s + 1:])


def mean_length(pmf: list[float]) -> float:
    return sum(j * p for j, p in enumerate(pmf))


def total_pmf(pmfs: list[list[float]]) -> list[float]:
    """P(Σ_i L_i = t): the proposal tokens a batch verifies."""
    out = [1.0]
    for p in pmfs:
        nxt = [0.0] * (len(out) + len(p) - 1)
        for t, a in enumerate(out):
            for n, b in enumerate(p):
                nxt[t + n] += a * b
        out = nxt
    return out


def verify_extra(costs: ForwardCosts, method: str, pmfs: list[list[float]],
                 factor: Callable[[int], float]) -> float:
    """Expected seconds of a step's verify beyond a decode (V(B, 1)), pmfs[i] the
    distribution of row i's proposal length, each width w's cost times factor(w) (measured
    forwards over the table's there). Priced as it runs: multi-query feeds every row its own
    L_i + 1 query tokens (packed, not padded), so a forward of B rows and Σ(L_i + 1) tokens
    costs the table at B rows and their mean width; batch expansion feeds B + Σ L_i rows
    (at their mean), each padded to the longest proposal M + 1. Nothing proposed: the call
    is a decode."""
    B = len(pmfs)
    decode = costs(B, 1) * factor(1)
    if method == "multi-query":
        return sum(p * (costs(B, 1 + t / B) * factor(round(1 + t / B)) - decode)
                   for t, p in enumerate(total_pmf(pmfs)) if t and p)
    rows = round(B + sum(mean_length(p) for p in pmfs))
    return sum(p * (costs(rows, m + 1) * factor(m + 1) - decode)
               for m, p in enumerate(longest_pmf(pmfs)) if m and p)


def verify_width(method: str, lens: list[int]) -> int:
    """The width a scoring call of proposal lengths `lens` is priced at (verify_extra): the
    mean for multi-query, the longest for batch expansion (1: nothing proposed)."""
    if not any(lens):
        return 1
    return round(1 + sum(lens) / len(lens)) if method == "multi-query" else max(lens) + 1


def draft_seconds(costs: ForwardCosts, pmfs: list[list[float]],
                  behind: list[int]) -> tuple[float, float]:
    """The draft table's seconds for a step's forwards: (steady, catch-up). Forward s
    (s >= 1) runs while any row is still drafting (P(L_i > s)), over the rows that are
    (their expected count, given that it runs); the first reads what each row missed, of
    which up to 2 tokens (the bonus token, and the last proposal when all were accepted)
    are the steady state and the rest is catch-up. The runner packs a forward's rows (no
    padding: specdecode.executor.model_runner), so the first costs the table at its rows
    and their mean width, as a multi-query verify does: priced padded to the longest, one
    request joining three at 20 tokens behind read as 4 x 20 tokens, its catch-up 3.8x what
    the packed 23 cost on the Qwen draft's start-up table."""
    drafting = [i for i, p in enumerate(pmfs) if len(p) > 1]
    steady = 0.0
    for s in range(1, max(len(p) for p in pmfs) - 1):
        stay = [longer_than(pmfs[i], s) for i in drafting]
        none = 1.0
        for q in stay:
            none *= 1.0 - q
        if none < 1.0:
            steady += (1.0 - none) * costs(max(1.0, sum(stay) / (1.0 - none)), 1)
    if not drafting:
        return steady, 0.0
    reads = [behind[i] for i in drafting]  # [n]: tokens each drafting row reads first
    n = len(reads)
    first = costs(n, sum(min(r, 2) for r in reads) / n)
    return steady + first, max(costs(n, sum(reads) / n) - first, 0.0)


@dataclass
class Acceptance:
    """Decayed counts of one sequence's (or all sequences') verification outcomes."""

    first_accepted: float = 0.0  # a proposal's first tokens accepted ...
    first_tried: float = 0.0  # ... of those tested
    later_accepted: float = 0.0  # its later tokens accepted (before the first rejection) ...
    later_tried: float = 0.0  # ... of those tested (accepted + the first rejected one)
    positions: int = 0  # ... and all of them, never decayed (the evidence behind alpha)
    proposed: float = 0.0  # steps where the proposer returned tokens ...
    asked: float = 0.0  # ... out of steps it was asked for some (n-gram may find none)
    continued: float = 0.0  # draft positions after which the draft went on ...
    tested: float = 0.0  # ... out of those where it could have stopped early
    speculated: bool = False  # it ever had a proposal verified
    plain_steps: int = 0  # steps without a proposal since it last had one ...
    plain_s: float = 0.0  # ... and their predicted seconds (its exploration budget)
    explore_after: int = EXPLORE_FIRST  # ... before it is explored (doubles each time)
    exploring: bool = False  # its last speculative step was an exploration

    @property
    def accepted(self) -> float:
        """Draft tokens accepted before the first rejection (decayed)."""
        return self.first_accepted + self.later_accepted

    @property
    def tried(self) -> float:
        """Positions tested: the accepted ones and the first rejected one (decayed)."""
        return self.first_tried + self.later_tried

    def alpha(self, prior: float | Rate, weight: float = PRIOR_WEIGHT,
              optimism: float = 0.0) -> Rate:
        """The posterior means of the first and the later positions' acceptance (decayed
        counts; the prior counts `weight` trials of each), plus `optimism` standard
        deviations of a Beta posterior of every position tested (the decay keeps the mean
        recent, not the evidence thin). The later positions' is at least the first's: a
        text mixes spans the draft gets right with spans it does not, and a position whose
        predecessors were accepted is more likely in an easy span (a mixture of geometric
        runs has a falling hazard); and a sequence at k = 1 tests only first positions.
        The prior gives up one of its trials per position the sequence tested, down to
        PRIOR_WEIGHT: its own counts are decayed (about five steps' worth), and a prior of
        16 trials at the 0.9 that code prompts left outweighed a prose sequence's 0.4 for
        good (48 tokens at k ~ 3.3, 0.89x plain decoding). The later positions' prior is
        the prior's, scaled by how this sequence's first positions compare with the
        prior's: a sequence at k = 1 tests no later position, and the 0.95 of code requests
        before it priced a prose one (first 0.45) at k = 3-4 on two hosts, where it
        accepted 1-2 tokens a step (0.87x / 0.79x fixed k = 2 on prose / Q&A)."""
        prior = Rate.of(prior)
        weight = max(min(weight, PRIOR_WEIGHT), weight - self.positions)
        evidence = self.positions + weight + 1.0

        def mean(accepted: float, tried: float, p: float) -> float:
            if tried + weight <= 0.0:  # the prior's later positions, decayed away
                return p
            m = (accepted + weight * p) / (tried + weight)
            return min(m + optimism * math.sqrt(m * (1.0 - m) / evidence), 1.0)
        first = mean(self.first_accepted, self.first_tried, prior.first)
        rest = prior.rest * first / prior.first if prior.first > 0.0 else prior.rest
        return Rate(first, max(mean(self.later_accepted, self.later_tried, min(rest, 1.0)), first))

    def trusted_k(self) -> int:
        """The most it may speculate on its own evidence: TRUST_GROWTH times its (decayed)
        accepted tokens, at least TRUST_START."""
        return max(TRUST_START, int(TRUST_GROWTH * self.accepted))

    def proposal_rate(self, weight: float = 1.0) -> float:
        return (self.proposed + weight) / (self.asked + weight)

    def continuation(self, prior: float, weight: float = PRIOR_WEIGHT) -> float:
        """How often the draft goes on after a proposal (1: it never stops early)."""
        return (self.continued + weight * prior) / (self.tested + weight)

    def drafted(self, asked: int, proposed: int, decay: float) -> None:
        """A draft model returned `proposed` of `asked` tokens: it went on after each but
        the last, and stopped early after the last when it is short of what was asked."""
        if not proposed:
            return
        stopped = 1 if proposed < asked else 0
        self.continued = decay * self.continued + proposed - 1
        self.tested = decay * self.tested + proposed - 1 + stopped

    def update(self, asked: int, proposed: int, accepted: int, decay: float) -> None:
        """asked: k requested; proposed: tokens the proposer returned; accepted: the accepted
        prefix length (tokens emitted - 1)."""
        tested = accepted + (1 if accepted < proposed else 0)
        self.first_accepted = decay * self.first_accepted + min(accepted, 1)
        self.first_tried = decay * self.first_tried + min(tested, 1)
        self.later_accepted = decay * self.later_accepted + max(accepted - 1, 0)
        self.later_tried = decay * self.later_tried + max(tested - 1, 0)
        self.positions += tested
        if asked:
            self.asked = decay * self.asked + 1
            self.proposed = decay * self.proposed + (1 if proposed else 0)

    def idle(self, decay: float) -> None:
        self.first_accepted *= decay
        self.first_tried *= decay
        self.later_accepted *= decay
        self.later_tried *= decay
        self.plain_steps += 1


@dataclass
class PriorWeight:
    """How many trials the all-sequences prior counts in a sequence's estimate: empirical
    Bayes over recently ended sequences (the method of moments for a Beta prior,
    n0 = μ(1-μ)/σ² - 1, σ² their acceptances' spread less what their own trial counts
    explain). Where sequences accept alike (a code assistant's requests) the prior weighs up
    to PRIOR_WEIGHT_MAX trials, and one exploration that met a disagreement (2 of 3
    positions) does not drop a fresh sequence to plain decoding for the rest of a short
    request; where they differ (code beside prose) it stays at PRIOR_WEIGHT and a
    sequence's own steps decide soon."""

    ended: deque = field(default_factory=lambda: deque(maxlen=32))  # (acceptance, tried)

    def add(self, est: Acceptance) -> None:
        if est.tried >= PRIOR_TRIED:
            self.ended.append((est.accepted / est.tried, est.tried))

    def weight(self) -> float:
        if len(self.ended) < PRIOR_SEQS:
            return PRIOR_WEIGHT
        mu = sum(a * t for a, t in self.ended) / sum(t for _, t in self.ended)
        spread = statistics.fmean((a - mu) ** 2 for a, _ in self.ended)
        between = spread - statistics.fmean(mu * (1.0 - mu) / t for _, t in self.ended)
        if between <= 0.0:
            return PRIOR_WEIGHT_MAX
        return min(max(mu * (1.0 - mu) / between - 1.0, PRIOR_WEIGHT), PRIOR_WEIGHT_MAX)


@dataclass
class Learned:
    """The median of the last LEARNED_WINDOW samples (the start-up guess until the first): a
    step preempted on a busy host (a 10 ms forward read 100 ms) moves it not at all, a
    lasting change is followed within half the window. `cautious` (a cost factor): until
    LEARNED_TRUST samples, the guess counts twice beside them where that reads cheaper, so
    one preempted step cannot price speculation out (a lone verify read 13x its table kept
    a stack plain for good: the waits between explorations double), while a step that
    reads cheaper than the guess is believed at once (the busy start-up table)."""

    value: float
    cautious: bool = False
    n: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=LEARNED_WINDOW), repr=False)

    def __post_init__(self):
        self.guess = self.value

    def add(self, x: float) -> None:
        self.n += 1
        self.recent.append(x)
        self.value = statistics.median(self.recent)
        if self.cautious and self.n < LEARNED_TRUST:
            self.value = min(self.value, statistics.median([*self.recent, self.guess, self.guess]))

    @property
    def measured(self) -> float:
        """The samples' median, without the guess's caution (the guess before any)."""
        return statistics.median(self.recent) if self.recent else self.value

    def scale(self, factor: float) -> None:
        """Every sample, the guess and the value times `factor`."""
        self.recent = deque((x * factor for x in self.recent), maxlen=LEARNED_WINDOW)
        self.value *= factor
        self.guess *= factor


@dataclass
class Realized:
    """One kind of step's (speculative or plain) predicted seconds over its measured ones,
    at one batch size: the residual the policy's corrections leave (widths and row counts
    no step measured yet, costs outside any table, cores the services contend for). A
    ratio of decayed sums. Times only: a step's tokens are a skewed draw (at 50%
    acceptance and k = 2, 1 token half the time, a mean of 1.75), and ten steps' worth of
    them, clipped at 1, read prose's predictions as too hopeful (1.14x → 1.04x own k=0);
    acceptance is learned per sequence."""

    predicted: float = 0.0
    seconds: float = 0.0
    steps: float = 0.0

    def add(self, predicted: float, seconds: float) -> None:
        d = REALIZED_DECAY
        self.predicted = d * self.predicted + predicted
        self.seconds = d * self.seconds + seconds
        self.steps = d * self.steps + 1.0

    def fade(self, decay: float) -> None:
        """The sums times `decay` (the ratio stays; its evidence, `steps`, shrinks)."""
        self.predicted, self.seconds, self.steps = (
            decay * self.predicted, decay * self.seconds, decay * self.steps)

    def ratio(self) -> float:
        """Predicted over measured seconds (1 before REALIZED_MIN steps)."""
        if self.steps < REALIZED_MIN or self.seconds <= 0:
            return 1.0
        return self.predicted / self.seconds


def factor_of(measured: float, predicted: float) -> float:
    """measured / predicted, within FACTOR_RANGE (1 when nothing was predicted)."""
    if predicted <= 0:
        return 1.0
    return min(max(measured / predicted, FACTOR_RANGE[0]), FACTOR_RANGE[1])


def trusted_limits(own: int, cap: int, risk: list[float]) -> list[int]:
    """[cap + 1]: the most a sequence may speculate up to each k. On its own evidence it may
    speculate `own` (Acceptance.trusted_k); beyond that, any k whose step risks no more
    than those do were nothing accepted (risk[k]): where a wider verify is cheaper (fp32 on
    CPU: 8 tokens measured 2.0 decodes, 3 tokens 3.6), a fresh sequence is not held to
    the dear widths."""
    budget = max(risk[:min(own, cap) + 1])
    out, best = [], 0
    for k in range(cap + 1):
        if k <= own or risk[k] <= budget:
            best = k
        out.append(best)
    return out
