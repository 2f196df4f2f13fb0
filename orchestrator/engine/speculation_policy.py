"""How many tokens each sequence speculates this step: the k that maximises expected tokens
per second, from each sequence's running acceptance estimate and the measured forward costs
of the draft and the target (docs/design.md, adaptive speculation).

A step's cost is shared by the batch: the draft's forwards, one target forward as wide as
the longest proposal plus one (batch expansion: sum(k_i + 1) rows), priced over the
distribution of proposal lengths (orchestrator.engine.policy_estimates), plus the RPC and
bookkeeping measured from earlier steps; k is chosen jointly, and k = 0 for all (plain
decoding, no proposer call) whenever the costs say speculation does not pay. Acceptance is
learned per sequence (decayed counts) over the all-sequences prior (weighed as alike as
ended sequences accepted: PriorWeight); a sequence speculates at most four times the draft
tokens it had accepted (at least 2), never beyond what it may still emit; a draft's
catch-up is priced at its real width and spread over the speculative steps left.

The tables are mended by what the steps take, each correction a ratio of whole times and a
running median (docs/design.md, *Noisy hosts and thin evidence*): the scoring call's RPC,
the host's scale from plain steps, each verify width's shape over it, the draft's factors.
A table taken on a busy host must not lock speculation off: when plain steps move the
host's scale by HOST_DRIFT, unmeasured draft factors follow and the tables count as
unchecked; while plain decoding is chosen the most promising speculative plan runs now and
then, within a budget of the plain time (policy_estimates' EXPLORE_* constants); the
services re-measure their tables while idle (specdecode.serving.recalibration) and a newer
table replaces the policy's (update_table).

Every plan says why (Plan.reasons, per sequence: REASONS) and its predicted speed-up over
plain decoding.
"""

from __future__ import annotations

import threading

from orchestrator.engine.lookahead_pricing import LookaheadPricing
from orchestrator.engine.policy_plan import (REASONS, Candidate, Plan, horizon, rate,
                                             steady_rate)
from orchestrator.engine.policy_estimates import (DECAY, EXPLORE_AT_ONCE_GAIN, EXPLORE_FIRST,
                                                  EXPLORE_FIRST_SHARE, EXPLORE_MAX,
                                                  EXPLORE_REQUEST_CAP, EXPLORE_SHARE,
                                                  EXPLORE_UNCHECKED_SHARE, GLOBAL_DECAY,
                                                  IDLE_DECAY, Acceptance, Learned, Rate,
                                                  PriorWeight, Realized, draft_seconds,
                                                  expected_tokens,
                                                  factor_of, length_pmf, point_pmf,
                                                  trusted_limits, verify_extra, verify_width)
from specdecode.cost_model import ForwardCosts, verify_seconds

__all__ = ["Candidate", "Plan", "REASONS", "SpeculationPolicy", "expected_tokens"]

# A sequence that has speculated decodes plainly only when speculation would not pay even
# at this many posterior standard deviations above its mean acceptance (two early
# rejections at 75% kept one plain for good; docs/design.md, *Noisy hosts*).
OPTIMISM = 1.0
EXTRA_MIN = 0.25  # a verify's cost beyond a decode, in decodes, that a correction may scale
GAIN_MARGIN = 1.02  # speculation must beat plain decoding by 2% (noise in the costs)
HOST_DRIFT = 1.3  # the scorer's scale moved this far: the draft's factors follow it
NO_MATCH_RATE = 0.5  # an n-gram sequence matching less often than this: "no_match"
# A catch-up this small beside the steady forwards (the draft 3-4 tokens behind after a
# grammar's forced tokens) is within their noise: its factor, the rest of the step over a
# few milliseconds, read 20x (FACTOR_RANGE's top), priced a 77-token catch-up at 5.4 s and
# kept JSON-schema requests plain (docs/design.md, *Noisy hosts and thin evidence*).
CATCH_UP_MIN = 0.5



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
        self.all = Acceptance(first_accepted=prior * 2, first_tried=2.0, later_accepted=prior * 2,
                              later_tried=2.0, continued=4.0, tested=4.0)
        self.prior_weight = PriorWeight()  # the trials `all` counts in a sequence's estimate
        self.measure_overheads = measure_overheads
        self.lookahead = lookahead  # prices drafting ahead too (None: lockstep only)
        self.step_s, self.ngram_s = Learned(0.0), Learned(0.0)  # outside the calls; n-gram call
        self._forget_tables()
        self._newer: dict[str, ForwardCosts] = {}  # tables handed over by update_table
        self._newer_lock = threading.Lock()

    def _forget_tables(self) -> None:
        """What was learned about the tables: the scoring call's RPC, the scale of the
        scorer's forwards, factors on the draft's forwards and the host's speed they
        assume."""
        self.rpc_s = Learned(0.0)  # a scoring call beyond the time the scorer reports
        self.propose_rpc_s = Learned(0.0)  # a proposer call beyond the time it reports
        # Factors (measured / the table's): the scorer's decodes (plain steps) ...
        self.verify_host = Learned(1.0, cautious=True)
        # ... each verify width's forwards over verify_host (where the table's shape is off:
        # timed while the other service loaded) ...
        self.verify_shape: dict[int, Learned] = {}
        self.draft_factor = Learned(1.0, cautious=True)  # ... steady draft forwards
        self.catch_up_factor = Learned(1.0, cautious=True)  # ... a catch-up's extra width
        self.host = 1.0  # the scorer's scale the draft's factors assume
        self.checked = False  # a speculative step measured these tables
        # (batch size, speculative) -> what that kind of step's predictions gave
        self.realized: dict[tuple[int, bool], Realized] = {}
        self.unchecked_plain_s = 0.0  # plain time decoded on them since last checked

    def update_table(self, role: str, costs: ForwardCosts) -> None:
        """A service's re-measured table (any thread): the next plan adopts it."""
        with self._newer_lock:
            self._newer[role] = costs

    def _adopt_tables(self) -> None:
        with self._newer_lock:
            newer, self._newer = self._newer, {}
        if not newer:
            return
        self.scorer_costs = newer.get("scorer", self.scorer_costs)
        self.draft_costs = newer.get("proposer", self.draft_costs)
        self._forget_tables()
        for est in self.seqs.values():  # due: the new table is checked at once
            est.plain_steps = max(est.plain_steps, est.explore_after)

    # -- choosing k ------------------------------------------------------------------------

    def plan(self, candidates: list[Candidate]) -> Plan:
        self._adopt_tables()
        caps = [min(c.cap, self.k_max) for c in candidates]
        if not self.adaptive or not candidates:
            return Plan(caps, "", 0.0, 0.0, reasons=["fixed" if k else "capped" for k in caps])
        prior, weight = self.all.alpha(0.5, 0.0), self.prior_weight.weight()
        est = [self.seqs.setdefault(c.seq_id, Acceptance()) for c in candidates]
        widest = self.scorer_costs.max_width - 1  # price only measured verify widths
        hard = [max(0, min(cap, c.remaining - 1, widest)) for cap, c in zip(caps, candidates)]
        risk = self._risks(max(hard, default=0))
        trusted = [trusted_limits(a.trusted_k(), h, risk) for a, h in zip(est, hard)]
        alphas = [a.alpha(prior, weight) for a in est]
        rates = [a.proposal_rate() if not self.draft_model else 1.0 for a in est]
        cont_prior = self.all.continuation(1.0, 0.0)
        conts = [a.continuation(cont_prior) if self.draft_model else 1.0 for a in est]

        def evaluate(ks, al=alphas, rs=rates):
            return self._evaluate(ks, al, rs, conts, candidates)
        plain = evaluate([0] * len(caps))
        best_spec = self._search(trusted, alphas, rates, evaluate)
        margin = rate(plain) * GAIN_MARGIN
        # A gain within what this batch size's predictions have been missing by is none.
        bar = margin / self._realized(len(candidates))
        best = plain
        if best_spec is not None and rate(best_spec) > bar:
            best = best_spec
        else:  # the evidence against speculating may be thin: what it could still gain
            hopeful = [a.alpha(prior, weight, OPTIMISM if a.positions else 0.0) for a in est]
            spec = self._search(trusted, hopeful, rates, lambda ks: evaluate(ks, hopeful))
            if spec is not None and rate(spec) > bar:
                best = evaluate(spec.ks)  # priced at the posterior means
        # The most speculation could gain: fully accepted, every proposal found, at up to
        # the caps, its steady steps (the catch-up is a probe's price, not the gain's).
        sure = 1.0
        if not any(best.ks) and any(caps):
            full = [min(cap, c.remaining - 1, widest) for cap, c in zip(caps, candidates)]
            certain, found = [Rate(1.0, 1.0)] * len(est), [1.0] * len(est)
            sure = max((steady_rate(evaluate([min(K, cap) for cap in full], certain, found))
                        / rate(plain)
                        for K in range(1, max(full, default=0) + 1)), default=1.0)
        chosen, over_budget = self._maybe_explore(best, best_spec, plain, est, candidates, sure)
        unrealized = not any(best.ks) and best_spec is not None and rate(best_spec) > margin
        chosen.speedup = rate(chosen) / rate(plain)
        chosen.best_speedup = rate(best_spec) / rate(plain) if best_spec else 1.0
        chosen.reasons = self._reasons(chosen, hard, rates, sure, over_budget, unrealized)
        if any(chosen.ks) and not chosen.explore:  # others' acceptance is evidence
            for a, k, cap in zip(est, chosen.ks, hard):
                if cap and not k:
                    a.explore_after = min(a.explore_after, EXPLORE_FIRST)
        return chosen

    def _search(self, limits: list[list[int]], alphas: list[Rate], rates: list[float],
                evaluate) -> Plan | None:
        """The best plan with every sequence at K (or the most it may speculate up to K:
        limits[i][K]), K = 1 .. the largest cap, each also with the 1, 2, 4, ... sequences
        least likely to gain left out."""
        best = None
        for K in range(1, max(len(lim) for lim in limits)):
            ks = [lim[min(K, len(lim) - 1)] for lim in limits]
            plan = evaluate(ks)
            spec = sorted((i for i, k in enumerate(ks) if k), key=lambda i: alphas[i].first * rates[i])
            drop = 1
            while drop < len(spec):
                left_out = set(spec[:drop])
                trial = evaluate([0 if i in left_out else k for i, k in enumerate(ks)])
                if rate(trial) > rate(plan):
                    plan = trial
                drop *= 2
            if best is None or rate(plan) > rate(best):
                best = plan
        return best

    def _reasons(self, plan: Plan, caps: list[int], rates: list[float], sure: float,
                 over_budget: bool, unrealized: bool) -> list[str]:
        """Why each sequence got its k (REASONS)."""
        if not self.checked:  # the tables say no; an exploration is to check them
            plain_why = "no_budget" if over_budget else "exploration_pending"
        elif unrealized:  # predicted to pay, by less than this batch size's steps missed by
            plain_why = "unrealized"
        else:
            plain_why = "verify_too_dear" if sure <= GAIN_MARGIN else ""
        out = []
        for k, cap, r in zip(plan.ks, caps, rates):
            if k:
                out.append("explore" if plan.explore else "speculate")
            elif not cap:
                out.append("capped")
            elif not any(plan.ks) and plain_why:
                out.append(plain_why)
            else:
                out.append("no_match" if r < NO_MATCH_RATE else "low_acceptance")
        return out

    def _maybe_explore(self, best: Plan, best_spec: Plan | None, plain: Plan,
                       est: list[Acceptance], candidates: list[Candidate],
                       sure: float) -> tuple[Plan, bool]:
        """Run the best speculative plan although plain decoding looks faster when one of its
        sequences is due (its plain steps reached its wait; or, on unchecked tables, one
        that never speculated, at its first decode step where a draft's catch-up is
        smallest, when fully accepted speculation would run EXPLORE_AT_ONCE_GAIN faster)
        and the predicted loss fits the budget, so that speculation's cost is measured
        rather than taken from the table. Returns the plan and whether a due exploration
        was over its budget."""
        if any(best.ks) or best_spec is None:
            return best, False
        for a in est:
            a.plain_s += plain.seconds
        if not self.checked:
            self.unchecked_plain_s += plain.seconds
        at_once = not self.checked and sure > EXPLORE_AT_ONCE_GAIN
        due = [i for i, k in enumerate(best_spec.ks)
               if k and (est[i].plain_steps >= est[i].explore_after
                         or at_once and not est[i].speculated)]
        if not due:
            return best, False
        if self.checked:  # each due sequence's own plain time pays: no request pays for all
            budget = EXPLORE_SHARE * min(est[i].plain_s for i in due)
        else:  # unchecked tables: a share of what the requests have left or have decoded
            left = plain.seconds * min(candidates[i].remaining for i in due)
            first = EXPLORE_REQUEST_CAP if at_once else EXPLORE_FIRST_SHARE
            budget = max(first * left, min(
                EXPLORE_UNCHECKED_SHARE * self.unchecked_plain_s, EXPLORE_REQUEST_CAP * left))
        loss = self._explore_loss(best_spec, plain)
        if loss > budget:
            return best, True
        if not self.checked:
            self.unchecked_plain_s = max(self.unchecked_plain_s - loss / EXPLORE_UNCHECKED_SHARE,
                                         0.0)
        for i in due:
            est[i].exploring = True
            est[i].plain_s -= loss
        best_spec.explore = True
        return best_spec, False

    def _explore_loss(self, spec: Plan, plain: Plan) -> float:
        """Predicted seconds an exploration costs beyond plain decoding of its tokens: its
        whole catch-up and the rest of its time."""
        steady = spec.seconds - spec.catch_up_s / spec.horizon
        return spec.catch_up_s + max(
            steady - spec.expected_tokens / plain.expected_tokens * plain.seconds, 0.0)

    def _evaluate(self, ks: list[int], alphas: list[Rate], rates: list[float],
                  conts: list[float], candidates: list[Candidate]) -> Plan:
        tokens = sum(1.0 + r * (expected_tokens(a, k, c) - 1.0)
                     for a, r, k, c in zip(alphas, rates, ks, conts))
        plan = Plan(ks, "", tokens, 0.0)
        pmfs = [length_pmf(k, c, r, self.draft_model) for k, c, r in zip(ks, conts, rates)]
        self._cost(plan, pmfs, candidates)
        if self.lookahead is not None:
            lens = [sum(j * p for j, p in enumerate(pmf)) for pmf in pmfs]  # expected lengths
            self.lookahead.price(plan, alphas, lens, self.step_s.value)
        return plan

    def _cost(self, plan: Plan, pmfs: list[list[float]], candidates: list[Candidate]) -> None:
        """Fill in the plan's scoring method and predicted seconds: pmfs[i] is the
        distribution of row i's proposal length."""
        ks = plan.ks
        B = len(ks)
        decode = self._verify_factor(1) * self.scorer_costs(B, 1)
        seconds = self.step_s.value + decode + self.rpc_s.value  # a plain call
        plan.scoring = "multi-query" if self.scoring == "auto" else self.scoring
        if max(ks) == 0:
            plan.seconds = max(seconds, 1e-6)
            return
        if self.draft_model:
            plan.behind = [c.behind for c in candidates]
            steady, catch_up = draft_seconds(self.draft_costs, pmfs, plan.behind)
            plan.draft_s, plan.catch_up = steady, catch_up
            plan.catch_up_s = self.catch_up_factor.value * catch_up
            plan.draft_seconds = self._propose_rpc() + self.draft_factor.value * steady
            if catch_up:
                plan.horizon = horizon(plan, candidates)
                plan.draft_seconds += plan.catch_up_s / plan.horizon
        else:
            plan.draft_seconds = self.ngram_s.value
        seconds += plan.draft_seconds
        methods = ("multi-query", "batch-expansion") if self.scoring == "auto" else (plan.scoring,)
        extra = {m: verify_extra(self.scorer_costs, m, pmfs, self._verify_factor)
                 for m in methods}
        plan.scoring = min(methods, key=lambda m: extra[m])
        plan.seconds = max(seconds + extra[plan.scoring], 1e-6)

    def _risks(self, k_max: int) -> list[float]:
        """[k_max + 1]: seconds one sequence's step at k costs beyond plain decoding were
        nothing accepted (its draft's steady forwards and the wider verify)."""
        risk = [0.0]
        for k in range(1, k_max + 1):
            pmf = [point_pmf(k)]
            if self.draft_model:
                drafting = self._propose_rpc() + self.draft_factor.value * draft_seconds(
                    self.draft_costs, pmf, [1])[0]
            else:
                drafting = self.ngram_s.value
            risk.append(drafting + verify_extra(self.scorer_costs, "multi-query", pmf,
                                                self._verify_factor))
        return risk

    def _verify_factor(self, width: int) -> float:
        """The scorer's measured forwards over the table's at `width`: the host's scale times
        the shape's correction there, carried from the nearest width a step measured (none:
        the table's shape) -- on what verifying costs beyond a decode where the table has
        enough of that to measure (EXTRA_MIN; a table timed while the other service loaded
        read every verify 4x a decode), else on the whole forward (bf16: a 5-token verify
        costs about a decode, and a ratio of that difference is noise)."""
        host = self.verify_host.value
        if width == 1 or not self.verify_shape:
            return host
        near = min(self.verify_shape, key=lambda w: (abs(w - width), w))
        shape = self.verify_shape[near].value
        costs = self.scorer_costs
        decode, at_near, at_width = costs(1, 1), costs(1, near), costs(1, width)
        if near == width or at_near - decode < EXTRA_MIN * decode:
            return host * shape
        beyond = max(at_near * shape - decode, 0.0) / (at_near - decode)
        return host * (decode + (at_width - decode) * beyond) / at_width

    def _propose_rpc(self) -> float:
        """A proposer call's time around its forwards: measured where the service reports
        its own time, else taken to be the scorer's."""
        return max(self.propose_rpc_s.value if self.propose_rpc_s.n else self.rpc_s.value, 0.0)

    # -- learning ----------------------------------------------------------------------------

    def observe(self, seq_id: int, asked: int, proposed: int, accepted_prefix: int) -> None:
        """One sequence's step: asked k, got `proposed` tokens, the first
        `accepted_prefix` of them were accepted."""
        est = self.seqs.setdefault(seq_id, Acceptance())
        if asked == 0:
            est.idle(IDLE_DECAY)
            return
        est.update(asked, proposed, accepted_prefix, DECAY)
        if not proposed:  # an n-gram found nothing: no speculation, and no probe
            est.plain_steps += 1
            return
        if est.exploring:
            est.explore_after = min(2 * est.explore_after, EXPLORE_MAX)
            est.exploring = False
        est.speculated = True
        est.plain_steps, est.plain_s = 0, 0.0
        if self.draft_model:
            est.drafted(asked, proposed, DECAY)
            self.all.drafted(asked, proposed, GLOBAL_DECAY)
        self.all.update(asked, proposed, accepted_prefix, GLOBAL_DECAY)

    def observe_step(self, plan: Plan, lens: list[int], propose_s: float, score_s: float,
                     total_s: float, busy: dict[str, float] | None = None) -> None:
        """Learn from a step's measured times: the time around the calls (sampling,
        bookkeeping), the scoring call's RPC and the scale of the scorer's forwards (every
        step), the draft's factors (speculative steps). lens: the proposal lengths actually scored; busy: role -> the seconds the
        remote service reported working on the step's calls (0 or absent in-process)."""
        if not (self.adaptive and self.measure_overheads and plan.ks):
            return
        busy = busy or {}
        self.step_s.add(max(total_s - propose_s - score_s, 0.0))
        self._learn_scorer(plan.scoring or "multi-query", lens, score_s, busy.get("scorer", 0.0))
        if max(plan.ks):
            if self.draft_model:
                # Priced as drafted: an early stop ran fewer forwards than the plan expected.
                pmfs = [point_pmf(n) if k else [1.0] for n, k in zip(lens, plan.ks)]
                steady, catch_up = draft_seconds(self.draft_costs, pmfs,
                                                 plan.behind or [1] * len(lens))
                if any(lens):
                    if busy.get("proposer", 0.0) > 0:
                        self.propose_rpc_s.add(propose_s - busy["proposer"])
                    self._learn_draft(propose_s - self._propose_rpc(), steady, catch_up)
            else:
                self.ngram_s.add(propose_s)

    def _learn_scorer(self, method: str, lens: list[int], score_s: float, busy: float) -> None:
        """The RPC (the call less the time the scorer reports: 0 in-process, where nothing is
        reported) and the scorer's forward over the table's cell: on a plain step the host's
        scale, on a verify the shape's correction at its width (over the host's scale, so a
        change of load, seen on plain steps, moves every width). The shape is over the
        host's scale as measured, not its cautious value, and shapes learned before the
        first plain step are divided by it: they hold the host's load, and counted again
        in the host's scale once it followed, a load the tables missed priced every verify
        at its square (docs/design.md, *Noisy hosts and thin evidence*)."""
        if busy > 0:
            self.rpc_s.add(max(score_s - busy, 0.0))
        forward = busy if busy > 0 else score_s - self.rpc_s.value
        ratio = factor_of(forward, verify_seconds(self.scorer_costs, method, lens))
        width = verify_width(method, lens)
        if width == 1:
            if self.verify_host.n == 0:  # the shapes so far hold the host's scale too
                for shape in self.verify_shape.values():
                    shape.scale(1 / ratio)
            self.verify_host.add(ratio)
            self._follow_host()
        else:
            shape = self.verify_shape.setdefault(width, Learned(1.0, cautious=True))
            shape.add(ratio / self.verify_host.measured)
            if not self.checked:
                self.checked, self.unchecked_plain_s = True, 0.0

    def _follow_host(self) -> None:
        """The scorer's decodes moved HOST_DRIFT from the host the draft's factors assume (the
        load that inflated the start-up tables is gone, or came): the draft's factors that
        no step measured yet follow it (its table was timed under the scorer's load; a
        measured factor already holds the load it was measured under, and rescaling it too
        counted the load twice: x16 on a busy host), the tables count as unchecked and
        every sequence is due for exploration (which measures the draft again). The plain
        time decoded on unchecked tables is kept: under a load that stays, the scale moves
        again and again, and restarting that budget at each move kept the stack plain."""
        host = self.verify_host.value
        if 1 / HOST_DRIFT <= host / self.host <= HOST_DRIFT:
            return
        scale, self.host = host / self.host, host
        for f in (self.draft_factor, self.catch_up_factor):
            if f.n == 0:
                f.scale(scale)
        self.checked = False
        for est in self.seqs.values():
            est.plain_steps = max(est.plain_steps, est.explore_after)

    def _learn_draft(self, measured: float, steady: float, catch_up: float) -> None:
        """The draft's factors: a catch-up forward (a prefill of what was missed) is off the
        table by other factors than a decode step, so a step with one teaches the catch-up
        factor (what is left after the steady forwards as predicted), one without the
        steady factor. One time cannot tell two factors apart: until a steady step was
        measured, a step with a catch-up teaches both the same one (the first exploration
        always reads the prompt; charged to the catch-up alone, it left a start-up table
        8x too dear pricing every later draft step, and speculation never ran again). A
        catch-up below CATCH_UP_MIN of the steady forwards teaches only the steady factor."""
        if catch_up and self.draft_factor.n == 0:
            both = factor_of(measured, steady + catch_up)
            self.draft_factor.add(both)
            self.catch_up_factor.add(both)
        elif catch_up >= CATCH_UP_MIN * steady:
            self.catch_up_factor.add(factor_of(measured - self.draft_factor.value * steady,
                                             catch_up))
        else:  # none, or too small to tell from the steady forwards' noise
            self.draft_factor.add(factor_of(measured, steady + catch_up))

    def _realized(self, rows: int) -> float:
        """How far speculative steps of `rows` rows fell short of their predictions beside
        plain steps of as many rows (Realized: theirs over plain's predicted-over-measured
        seconds), at most 1: a miss that both kinds share (a load on the whole host, which
        two pinned hosts' plain steps read too) is no reason to stop speculating."""
        spec, plain = self.realized.get((rows, True)), self.realized.get((rows, False))
        if spec is None:
            return 1.0
        return min(spec.ratio() / (1.0 if plain is None else plain.ratio()), 1.0)

    def observe_outcome(self, plan: Plan, seconds: float) -> None:
        """A step's whole seconds beside the plan's prediction teach its kind's Realized at
        that batch size (a speculative step only without a catch-up, whose prediction
        spreads it over later steps). A plain step fades the speculative steps' record
        (IDLE_DECAY: 7-60 plain steps on, by how much it holds, it is below REALIZED_MIN,
        and speculation is tried again); the plain steps' record stands until plain
        steps renew it (faded, it would stop a speculation that misses as they do every
        ~10 steps)."""
        if not self.adaptive or seconds <= 0 or plan.seconds <= 0:
            return
        rows, speculative = len(plan.ks), any(plan.ks)
        if not speculative and (spec := self.realized.get((rows, True))) is not None:
            spec.fade(IDLE_DECAY)
        if not plan.catch_up:
            self.realized.setdefault((rows, speculative), Realized()).add(plan.seconds, seconds)

    def draft_token_seconds(self, rows: int) -> float:
        """One draft forward of `rows` rows, as learned (0: no draft table)."""
        if self.draft_costs is None:
            return 0.0
        return self.draft_costs(rows, 1) * self.draft_factor.value

    def forget(self, seq_ids: list[int]) -> None:
        for s in seq_ids:
            est = self.seqs.pop(s, None)
            if est is not None and est.speculated:
                self.prior_weight.add(est)
