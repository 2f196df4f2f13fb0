"""What drafting ahead (orchestrator.engine.lookahead) costs and saves, in the speculation
policy's terms (docs/design.md, *Asynchronous drafting*).

With drafting ahead the proposer drafts step t+1's proposal while the scorer verifies step
t's. When step t's lookahead hits (every proposal accepted and the draft's guess of the
target's token right: probability h), step t+1 drafts nothing; on a miss it drafts afresh,
as lockstep does. A step whose every proposal was accepted (probability a) waits for the
part of its lookahead that outlasted the verify (the guess is known only then):

    lockstep:  T = O + D + V
    ahead:     T = O + V + a max(0, D' - V) + (1 - h) D + c min(D', V)

D: the policy's seconds for the step's draft (forwards and the call); D' = D (K + 1) / K, a
lookahead drafts one token more per row (its guess of the target's); V: the scoring call; O:
the rest of the step. c is the contention: 0 when the two services run on different hosts
or cores, 1 when they share cores (then every lookahead forward delays the verify beside it
as much, and drafting ahead never pays: `auto` turns it off). a = the product over the
speculating rows of their chance that n proposals are all accepted (n: the expected
proposal length; Rate.all_accepted), h = a times beta^rows, beta how often the draft's
guess was right when every proposal was accepted (learned from the lookaheads; the later
positions' acceptance before any). In a steady state h is also the chance that the step before
hit, which is what saves this step's draft.

The policy prices every plan it weighs both ways (so k is chosen for the cost that will
run) and marks the plans that draft ahead (`Plan.ahead`). Where it does not price (fixed
speculation, no measured costs), `auto` drafts ahead exactly when the services do not share
cores: there a lookahead adds at most the cancelled part of one forward to a miss.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.engine.policy_estimates import Rate

AHEAD_GAIN = 1.01  # drafting ahead must beat lockstep by 1% (noise in the costs)
DECAY = 0.95  # weight of earlier evidence of beta, per settled lookahead row
PRIOR_WEIGHT = 4.0  # pseudo-rows of the prior (alpha) in beta
MAX_FIT = 1 << 16  # no bound on a lookahead's length (unpriced plans)


@dataclass
class LookaheadPricing:
    mode: str = "auto"  # "auto": where it pays; "on": always (off: no pricing at all)
    contention: float = 0.0  # 0: the services share no cores; 1: they do
    full: float = 0.0  # decayed: lookahead rows whose every proposal was accepted ...
    right: float = 0.0  # ... and of those, hits (the draft guessed the target's token)

    def beta(self, alpha: float) -> float:
        """How often the draft guesses the target's token after an all-accepted proposal."""
        return (self.right + PRIOR_WEIGHT * alpha) / (self.full + PRIOR_WEIGHT)

    def price(self, plan, alphas: list[Rate], lens: list[float], step_s: float) -> None:
        """Price `plan` (its `seconds` and `draft_seconds` priced in lockstep) with drafting
        ahead too; keep the faster (`on`: drafting ahead) and mark it in plan.ahead.
        lens: each row's expected proposal length."""
        K = max(plan.ks, default=0)
        D = plan.draft_seconds
        if K == 0 or D <= 0.0:
            return
        accepted = hit = 1.0
        for alpha, n, k in zip(alphas, lens, plan.ks):
            if k:
                accepted *= alpha.all_accepted(n)
                hit *= alpha.all_accepted(n) * self.beta(alpha.rest)
        V = max(plan.seconds - D - step_s, 0.0)
        plan.verify_seconds = V
        ahead_d = D * (K + 1) / K
        ahead = (plan.seconds - D + accepted * max(0.0, ahead_d - V) + (1.0 - hit) * D
                 + self.contention * min(ahead_d, V))
        if self.mode == "on" or ahead * AHEAD_GAIN < plan.seconds:
            plan.seconds, plan.ahead = ahead, True

    @staticmethod
    def fit(plan, per_token: float) -> int:
        """The most proposal tokens a lookahead should draft after its guess: as many as the
        verify it runs beside lasts (PEARL's post-verify: a longer one makes a hit's step
        wait for it; traced on two hosts, 0.45-0.58 s on 5 of 14 steps at k = 7-8 beside a
        0.34 s verify), at least 1; unbounded where the plan was not priced. per_token: one
        draft forward's seconds at the step's rows (not the plan's draft seconds over k:
        priced with early stops, those read 0.2 s for k = 7 where the draft went on)."""
        if plan.verify_seconds <= 0.0 or per_token <= 0.0:
            return MAX_FIT
        return max(1, int(plan.verify_seconds / per_token) - 1)

    def unpriced(self) -> bool:
        """Whether to draft ahead where the policy does not price (fixed speculation)."""
        return self.mode == "on" or self.contention == 0.0

    def observe(self, full: int, hits: int) -> None:
        """Settled lookahead rows: `full` had every proposal accepted, `hits` of them hit."""
        if full:
            self.full = DECAY * self.full + full
            self.right = DECAY * self.right + hits
