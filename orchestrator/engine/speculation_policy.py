"""How many tokens each sequence speculates this step: the k that maximises expected tokens
per second, from each sequence's running acceptance estimate and the measured forward costs
of the draft and the target (docs/design.md, adaptive speculation).

With per-token acceptance α, a sequence proposing k tokens emits on average

    E(α, k) = 1 + α + ... + α^k = (1 - α^(k+1)) / (1 - α)

tokens (the accepted prefix plus the target's token). A step's cost is shared by the whole
batch: K draft steps (one forward each over the sequences still drafting), one target forward
of K+1 tokens per row (multi-query; batch expansion feeds sum(k_i + 1) rows), plus the RPC and
bookkeeping time measured from earlier steps. k = 0 for every sequence skips the proposer and
is plain decoding, so the policy never picks speculation that its costs say does not pay: low
acceptance, proposers that rarely find an n-gram, a large batch or slow multi-token forwards.

Acceptance is learned per sequence from what verification accepted (decayed counts, so it
follows a sequence moving from prose into code), blended with the running acceptance of all
sequences as a prior; a sequence that stopped speculating slowly forgets its evidence and is
tried again once the prior makes speculation look worth it. The prior is other sequences'
acceptance, so a sequence speculates at most four times the draft tokens it has itself had
accepted (at least 2: k = 2, 8, 16, ... while all are accepted): a prose request arriving
after code requests risks two cheap proposals, not k = 16 on code's acceptance (a draft
that stops early when unsure cuts even those short). Nor does a sequence speculate beyond
what it may still emit: k + 1 tokens at most, so k < the tokens its request has left.

A draft model holds KV state only for what it was sent: after plain steps (and after the
prompt, which it never sees) its first forward must read every token it missed (catch-up),
a forward of that many query tokens. The policy counts it, spread over the speculative
steps the request has left (the draft then stays current), so a long plain stretch does
not lock speculation out where it pays, while a short one is not worth the catch-up.

The services' cost tables are measured once at start-up; timed while the other service
loads on the same cores they can be several times off (`specdecode up` therefore starts
one service after the other). The policy corrects them with what its own steps take (RPC
included; steps that compute a prompt teach nothing): an additive term learned on
plain-decoding steps, and a factor per verify width on what verifying costs beyond a decode
(and on the draft's forwards: one for its steady steps, one for a catch-up; until a steady
step was measured, a step with a catch-up teaches both) learned on speculative ones.
A correction can only be learned for a width that runs, so while plain decoding is chosen
the policy now and then runs the most promising speculative plan instead (exploration): a
sequence is explored after 8 of its plain steps, then 16, 32, ... up to 256. The first
exploration checks the start-up table: it runs while its predicted loss (the whole catch-up
and the time beyond plain decoding of the same tokens) fits in 3% of the plain time its
requests have left, so a short request does not pay for a long catch-up. Later ones run
only while their predicted loss fits in 2% of the time each sequence it explores spent
decoding plainly since it last speculated (its own time: a budget saved while other
requests decoded plainly is not spent on one request).
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.engine.lookahead_pricing import LookaheadPricing
from specdecode.cost_model import ForwardCosts, verify_seconds

DECAY = 0.8  # weight of a sequence's earlier evidence after each speculative step
IDLE_DECAY = 0.98  # ... after each step without a proposal (half-life ~34 steps)
GLOBAL_DECAY = 0.98  # the all-sequences prior, per speculative sequence-step
PRIOR_WEIGHT = 2.0  # pseudo-trials of the prior in a sequence's estimate
OVERHEAD_WEIGHT = 0.2  # EWMA weight of one step's measured times (once warmed up)
GAIN_MARGIN = 1.02  # speculation must beat plain decoding by 2% (noise in the costs)
EXPLORE_FIRST = 8  # a sequence's plain steps before its first exploratory step ...
EXPLORE_MAX = 256  # ... the wait doubles after each exploration, up to this
EXPLORE_SHARE = 0.02  # an exploration's predicted loss: at most this share of the plain time
EXPLORE_FIRST_SHARE = 0.03  # ... the first's: of the plain time its requests have left
EXPLORE_AT_ONCE_GAIN = 1.5  # a fresh server's first exploration is due at a sequence's first
# decode step when the tables say fully accepted speculation would run this much faster
FACTOR_RANGE = (0.05, 20.0)  # bounds on a learned cost factor (one wild sample)
TRUST_START, TRUST_GROWTH = 2, 4  # k on a sequence's own evidence: 2, then 4x its accepted


def expected_tokens(alpha: float, k: int, cont: float = 1.0) -> float:
    """E(α, k): tokens one sequence emits from up to k proposals at per-token acceptance α,
    when the draft goes on after each proposal with probability `cont` (early stop):
    1 + Σ_{j=1..k} cont^(j-1) α^j."""
    if k <= 0:
        return 1.0
    if cont >= 1.0:
        if alpha >= 1.0:
            return k + 1.0
        return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    return 1.0 + sum(cont ** (j - 1) * alpha ** j for j in range(1, k + 1))


def expected_len(k: int, cont: float = 1.0) -> float:
    """Expected proposal length (= draft forwards) when asking for k: Σ_{j=1..k} cont^(j-1)."""
    if cont >= 1.0:
        return float(max(k, 0))
    return sum(cont ** (j - 1) for j in range(1, k + 1))


@dataclass
class Acceptance:
    """Decayed counts of one sequence's (or all sequences') verification outcomes."""

    accepted: float = 0.0  # draft tokens accepted before the first rejection
    tried: float = 0.0  # positions that were tested (accepted + the first rejected one)
    proposed: float = 0.0  # steps where the proposer returned tokens ...
    asked: float = 0.0  # ... out of steps it was asked for some (n-gram may find none)
    continued: float = 0.0  # draft positions after which the draft went on ...
    tested: float = 0.0  # ... out of those where it could have stopped early
    plain_steps: int = 0  # steps without speculation since it last speculated ...
    plain_s: float = 0.0  # ... and their predicted seconds (its exploration budget)
    explore_after: int = EXPLORE_FIRST  # ... before it is explored (doubles each time)

    def alpha(self, prior: float, weight: float = PRIOR_WEIGHT) -> float:
        return (self.accepted + weight * prior) / (self.tried + weight)

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
        self.accepted = decay * self.accepted + accepted
        self.tried = decay * self.tried + accepted + (1 if accepted < proposed else 0)
        if asked:
            self.asked = decay * self.asked + 1
            self.proposed = decay * self.proposed + (1 if proposed else 0)

    def idle(self, decay: float = IDLE_DECAY) -> None:
        self.accepted *= decay
        self.tried *= decay
        self.plain_steps += 1


@dataclass
class Learned:
    """A running mean that trusts its first samples fully (1/n) and then weighs each new one
    OVERHEAD_WEIGHT, so one observation replaces a start-up guess and later ones track drift."""

    value: float
    n: int = 0

    def add(self, x: float) -> None:
        self.n += 1
        self.value += max(OVERHEAD_WEIGHT, 1.0 / self.n) * (x - self.value)


def _factor(measured: float, predicted: float) -> float:
    """measured / predicted, within FACTOR_RANGE (1 when nothing was predicted)."""
    if predicted <= 0:
        return 1.0
    return min(max(measured / predicted, FACTOR_RANGE[0]), FACTOR_RANGE[1])


@dataclass
class Candidate:
    """One sequence as the policy sees it this step."""

    seq_id: int
    cap: int  # the most it may speculate (request cap, server max, room left; 0 = none)
    behind: int = 1  # tokens a draft model must read before proposing (1: the last one)
    remaining: int = 1 << 30  # tokens the request may still produce


@dataclass
class Plan:
    ks: list[int]  # [B] speculation length per sequence
    scoring: str  # the scoring method the costs predict ("" when not predicted)
    expected_tokens: float
    seconds: float  # predicted step time (catch-up spread over the steps left)
    explore: bool = False  # speculating although plain decoding was predicted faster
    draft_s: float = 0.0  # the draft table's seconds for the step's steady forwards ...
    catch_up: float = 0.0  # ... and for its catch-up (both before the learned factors)
    catch_up_s: float = 0.0  # predicted seconds of the draft's catch-up (whole, not spread)
    horizon: float = 1.0  # speculative steps the catch-up is spread over
    behind: list[int] | None = None  # [B] tokens each row's draft had to read first
    draft_seconds: float = 0.0  # the draft's part of `seconds` in lockstep (call included)
    ahead: bool = False  # priced drafting ahead (orchestrator.engine.lookahead_pricing)


class SpeculationPolicy:
    """adaptive=False: every sequence speculates its cap (fixed k, the old behaviour)."""

    def __init__(self, k_max: int, *, adaptive: bool = True,
                 scorer_costs: ForwardCosts | None = None,
                 draft_costs: ForwardCosts | None = None, draft_model: bool = True,
                 scoring: str = "auto", prior: float = 0.6, measure_overheads: bool = True,
                 lookahead: LookaheadPricing | None = None):
        """scorer_costs / draft_costs: measured forward costs (ModelInfo.forward_cost);
        draft_model False: an n-gram proposer (no forward cost); scoring: the scorer's
        method (auto | multi-query | batch-expansion); prior: the acceptance assumed before
        any is observed; measure_overheads: add the time each step spends outside the
        predicted forwards (RPCs, sampling), learned from earlier steps."""
        self.k_max = k_max
        self.scorer_costs, self.draft_costs, self.draft_model = scorer_costs, draft_costs, draft_model
        self.adaptive = adaptive and scorer_costs is not None and (
            draft_costs is not None or not draft_model)
        self.scoring = scoring
        self.seqs: dict[int, Acceptance] = {}
        self.all = Acceptance(accepted=prior * 4, tried=4.0, continued=4.0, tested=4.0)
        self.measure_overheads = measure_overheads
        self.lookahead = lookahead  # prices drafting ahead too (None: lockstep only)
        # Learned from the steps (seconds): outside the calls; a plain scoring call beyond the
        # table's decode (RPC, and the table's error); an n-gram proposer call. Factors on
        # the tables: per verify width (on the cost beyond a decode), on the draft's forwards.
        self.step_s, self.rpc_s, self.ngram_s = Learned(0.0), Learned(0.0), Learned(0.0)
        self.verify_factor: dict[int, Learned] = {}
        self.draft_factor = Learned(1.0)  # steady draft forwards (1-2 new tokens)
        self.catch_up_factor = Learned(1.0)  # the extra width of a catch-up forward

    # -- choosing k ------------------------------------------------------------------------

    def plan(self, candidates: list[Candidate]) -> Plan:
        caps = [min(c.cap, self.k_max) for c in candidates]
        if not self.adaptive or not candidates:
            return Plan(caps, "", 0.0, 0.0)
        prior = self.all.alpha(0.5, 0.0)
        est = [self.seqs.setdefault(c.seq_id, Acceptance()) for c in candidates]
        caps = [max(0, min(cap, a.trusted_k(), c.remaining - 1))
                for cap, a, c in zip(caps, est, candidates)]
        alphas = [a.alpha(prior) for a in est]
        rates = [a.proposal_rate() if not self.draft_model else 1.0 for a in est]
        cont_prior = self.all.continuation(1.0, 0.0)
        conts = [a.continuation(cont_prior) if self.draft_model else 1.0 for a in est]
        evaluate = lambda ks, al=alphas: self._evaluate(ks, al, rates, conts,  # noqa: E731
                                                        candidates)
        plain = best = evaluate([0] * len(caps))
        best_spec = None
        for K in range(1, max(caps, default=0) + 1):
            ks = [min(K, cap) for cap in caps]
            plan = evaluate(ks)
            # Leave out the 1, 2, 4, ... sequences least likely to gain, if that pays.
            spec = sorted((i for i, k in enumerate(ks) if k), key=lambda i: alphas[i] * rates[i])
            drop = 1
            while drop < len(spec):
                left_out = set(spec[:drop])
                trial = evaluate([0 if i in left_out else k for i, k in enumerate(ks)])
                if _rate(trial) > _rate(plan):
                    plan = trial
                drop *= 2
            if best_spec is None or _rate(plan) > _rate(best_spec):
                best_spec = plan
        if best_spec is not None and _rate(best_spec) > _rate(plain) * GAIN_MARGIN:
            best = best_spec
        at_once = False
        if (best_spec is not None and not any(best.ks) and not self.verify_factor
                and not all(a.asked for a in est)):
            # Nothing speculative measured yet (a fresh server) and a sequence that never
            # speculated (only such a one is due at once): could it pay well, fully accepted
            # at up to the caps (its steady steps: the catch-up is the probe's)?
            full = [min(c.cap, self.k_max) for c in candidates]
            for K in range(1, max(full) + 1):
                sure = evaluate([min(K, cap) for cap in full], [1.0] * len(est))
                steady = sure.seconds - sure.catch_up_s / sure.horizon
                if sure.expected_tokens / steady > EXPLORE_AT_ONCE_GAIN * _rate(plain):
                    at_once = True
                    break
        return self._maybe_explore(best, best_spec, plain, est, candidates, at_once)

    def _maybe_explore(self, best: Plan, best_spec: Plan | None, plain: Plan,
                       est: list[Acceptance], candidates: list[Candidate],
                       at_once: bool = False) -> Plan:
        """Run the best speculative plan although plain decoding looks faster when one of its
        sequences is due (its plain steps reached its wait; at_once: its first exploration
        is due now, at its first decode step, where the draft's catch-up is smallest) and
        the predicted loss fits the budget, so that speculation's cost is measured rather
        than taken from the table."""
        if any(best.ks) or best_spec is None:
            return best
        for a in est:
            a.plain_s += plain.seconds
        due = [i for i, k in enumerate(best_spec.ks)
               if k and (est[i].plain_steps >= est[i].explore_after
                         or at_once and not est[i].asked)]  # never speculated
        if not due:
            return best
        if self.verify_factor:
            # Each due sequence's own plain time pays: the loss never concentrates on one
            # request.
            budget = EXPLORE_SHARE * min(est[i].plain_s for i in due)
        else:  # the unchecked start-up table: a share of what the requests have left
            budget = EXPLORE_FIRST_SHARE * plain.seconds * min(candidates[i].remaining
                                                               for i in due)
        if self._explore_loss(best_spec, plain) > budget:
            return best
        for i in due:
            est[i].explore_after = min(2 * est[i].explore_after, EXPLORE_MAX)
        best_spec.explore = True
        return best_spec

    def _explore_loss(self, spec: Plan, plain: Plan) -> float:
        """Predicted seconds an exploration costs beyond plain decoding of its tokens: its
        whole catch-up and the rest of its time."""
        steady = spec.seconds - spec.catch_up_s / spec.horizon
        return spec.catch_up_s + max(
            steady - spec.expected_tokens / plain.expected_tokens * plain.seconds, 0.0)

    def _evaluate(self, ks: list[int], alphas: list[float], rates: list[float],
                  conts: list[float], candidates: list[Candidate]) -> Plan:
        tokens = sum(1.0 + r * (expected_tokens(a, k, c) - 1.0)
                     for a, r, k, c in zip(alphas, rates, ks, conts))
        plan = Plan(ks, "", tokens, 0.0)
        self._cost(plan, rates, conts, candidates)
        if self.lookahead is not None:
            self.lookahead.price(plan, alphas, [expected_len(k, c) for k, c in zip(ks, conts)],
                                 self.step_s.value)
        return plan

    def _cost(self, plan: Plan, rates: list[float], conts: list[float],
              candidates: list[Candidate]) -> None:
        """Fill in the plan's scoring method and predicted seconds."""
        ks = plan.ks
        B, K = len(ks), max(ks)
        decode = self.scorer_costs(B, 1) + self.rpc_s.value  # a plain scoring call
        seconds = self.step_s.value + decode
        plan.scoring = "multi-query" if self.scoring == "auto" else self.scoring
        if K == 0:
            plan.seconds = max(seconds, 1e-6)
            return
        if self.draft_model:
            plan.behind = [c.behind for c in candidates]
            steady, catch_up = self._drafted(ks, plan.behind, conts)
            plan.draft_s, plan.catch_up = steady, catch_up
            plan.catch_up_s = self.catch_up_factor.value * catch_up
            plan.draft_seconds = self._rpc() + self.draft_factor.value * steady
            if catch_up:
                plan.horizon = _horizon(plan, candidates)
                plan.draft_seconds += plan.catch_up_s / plan.horizon
        else:
            plan.draft_seconds = self.ngram_s.value
        seconds += plan.draft_seconds
        # An early-stopping draft proposes fewer tokens than asked: verify what it is expected
        # to propose.
        lens = [expected_len(k, c) for k, c in zip(ks, conts)]
        if self.scoring == "auto":
            plan.scoring = min(("multi-query", "batch-expansion"),
                               key=lambda m: verify_seconds(self.scorer_costs, m, lens))
        # What verifying costs beyond a decode, as the table says, mended by what was measured.
        extra = (verify_seconds(self.scorer_costs, plan.scoring, lens) - self.scorer_costs(B, 1)
                 ) * self._verify_factor(round(max(lens)) + 1)
        # An n-gram proposer may find nothing: when no row has a proposal, the step's
        # scoring is a decode.
        p_none = 1.0
        for r, k in zip(rates, ks):
            p_none *= 1.0 - (r if k else 0.0)
        plan.seconds = max(seconds + extra * (1.0 - p_none), 1e-6)

    def _rpc(self) -> float:
        """One call's time around the forward (the proposer's is taken to be the scorer's)."""
        return max(self.rpc_s.value, 0.0)

    def _drafted(self, ks: list[int], behind: list[int],
                 conts: list[float] | None = None) -> tuple[float, float]:
        """The draft table's seconds for the step's forwards: (steady, catch-up). Step s runs
        over the rows still drafting (a row asked for k goes on past step s with
        probability conts^s: early stop; an expected count of rows below one costs that
        share of one row); the first reads what each row missed (padded to the longest), of
        which up to 2 tokens (the bonus token, and the last proposal when all were accepted)
        are the steady state and the rest is catch-up."""
        conts = conts or [1.0] * len(ks)
        rows = sum(1 for k in ks if k)
        width = max((b for b, k in zip(behind, ks) if k), default=1)
        steady = 0.0
        for s in range(1, max(ks)):
            active = sum(c ** s for k, c in zip(ks, conts) if k > s)
            steady += (self.draft_costs(active, 1) if active >= 1
                       else active * self.draft_costs(1, 1))
        first = self.draft_costs(rows, min(width, 2))
        return steady + first, max(self.draft_costs(rows, width) - first, 0.0)

    def _verify_factor(self, width: int) -> float:
        """The learned factor of the nearest verify width measured (1 before any)."""
        if not self.verify_factor:
            return 1.0
        return self.verify_factor[min(self.verify_factor, key=lambda w: (abs(w - width), w))].value

    # -- learning ----------------------------------------------------------------------------

    def observe(self, seq_id: int, asked: int, proposed: int, accepted_prefix: int) -> None:
        """One sequence's step: asked k, got `proposed` tokens, the first
        `accepted_prefix` of them were accepted."""
        est = self.seqs.setdefault(seq_id, Acceptance())
        if asked == 0:
            est.idle()
            return
        est.plain_steps, est.plain_s = 0, 0.0
        est.update(asked, proposed, accepted_prefix, DECAY)
        if self.draft_model:
            est.drafted(asked, proposed, DECAY)
            self.all.drafted(asked, proposed, GLOBAL_DECAY)
        if proposed:
            self.all.update(asked, proposed, accepted_prefix, GLOBAL_DECAY)

    def observe_step(self, plan: Plan, lens: list[int], propose_s: float, score_s: float,
                     total_s: float) -> None:
        """Learn from a step's measured times: the time around the calls (RPCs, sampling,
        bookkeeping) on plain steps, the factor by which the tables were off on speculative
        ones. lens: the proposal lengths actually scored."""
        if not (self.adaptive and self.measure_overheads and plan.ks):
            return
        self.step_s.add(max(total_s - propose_s - score_s, 0.0))
        width = max(lens, default=0) + 1
        decode = self.scorer_costs(len(lens), 1)
        if width == 1:  # a decode (n-gram may have found nothing): the RPC, and the table's error
            self.rpc_s.add(score_s - decode)
        else:  # how far off the table's cost of verifying beyond a decode was
            extra = verify_seconds(self.scorer_costs, plan.scoring or "multi-query", lens) - decode
            self.verify_factor.setdefault(width, Learned(1.0)).add(
                _factor(score_s - self.rpc_s.value - decode, extra))
        if max(plan.ks):
            if self.draft_model:
                # Priced as drafted: an early stop ran fewer forwards than the plan expected.
                steady, catch_up = self._drafted([n if k else 0 for n, k in zip(lens, plan.ks)],
                                                 plan.behind or [1] * len(lens))
                if any(lens):
                    self._learn_draft(propose_s - self._rpc(), steady, catch_up)
            else:
                self.ngram_s.add(propose_s)

    def _learn_draft(self, measured: float, steady: float, catch_up: float) -> None:
        """The draft's factors: a catch-up forward (a prefill of what was missed) is off the
        table by other factors than a decode step, so a step with one teaches the catch-up
        factor (what is left after the steady forwards as predicted), one without the
        steady factor. One time cannot tell two factors apart: until a steady step was
        measured, a step with a catch-up teaches both the same one (the first exploration
        always reads the prompt; charged to the catch-up alone, it left a start-up table
        8x too dear pricing every later draft step, and speculation never ran again)."""
        if catch_up and self.draft_factor.n == 0:
            both = _factor(measured, steady + catch_up)
            self.draft_factor.add(both)
            self.catch_up_factor.add(both)
        elif catch_up:
            self.catch_up_factor.add(_factor(measured - self.draft_factor.value * steady,
                                             catch_up))
        else:
            self.draft_factor.add(_factor(measured, steady))

    def forget(self, seq_ids: list[int]) -> None:
        for s in seq_ids:
            self.seqs.pop(s, None)


def _rate(plan: Plan) -> float:
    """Expected tokens per second."""
    return plan.expected_tokens / plan.seconds


def _horizon(plan: Plan, candidates: list[Candidate]) -> float:
    """Speculative steps a catch-up is spread over: the tokens the speculating sequences
    have left, at the plan's expected tokens per sequence-step (at least 1)."""
    left = [c.remaining for c, k in zip(candidates, plan.ks) if k]
    per_seq_step = plan.expected_tokens / len(plan.ks)
    return max(1.0, sum(left) / len(left) / per_seq_step)
