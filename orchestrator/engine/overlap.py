"""Overlap: the running sequences split into two groups that alternate, so that while the
scorer verifies one group the proposer drafts the other, and both hosts work at once.

Each engine step verifies one group. Its proposals were requested one step earlier (or just
now, at the start), and before it is scored the other group's proposals are requested on a
worker thread, to run on the proposer while the scorer works:

    step t:    propose B (thread)  ‖  score A, verify A
    step t+1:  propose A (thread)  ‖  score B, verify B

A group's tokens do not change between its proposals and its scoring (only the other group
is verified in between), and every draw is seeded per sequence and position, so each
sequence sees exactly the tokens it would see without overlap. New requests join the group
that is proposed next. A sequence cancelled while its proposals are in flight is handed back
for release once that call has returned (so no service call re-creates its state after the
release).

With one group (a single sequence) nothing overlaps. The in-process engine gains nothing
(proposer and scorer share the same cores); use it with remote services.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from specdecode.telemetry import tracing
from specdecode.interfaces import SpeculativeProposals
from specdecode.sequence import ExecuteModelRequest


@dataclass
class Planned:
    """A group whose proposals were requested: seqs[i] is row i of req."""

    seqs: list  # [B] orchestrator.engine.core.Sequence
    req: ExecuteModelRequest
    plan: Any  # the speculation plan (orchestrator.engine.speculation_policy.Plan): ks per row
    future: concurrent.futures.Future  # -> SpeculativeProposals for the rows in `rows`
    rows: list[int] | None = None  # the rows still running (None = all)

    def proposals(self) -> SpeculativeProposals:
        """Wait for the proposals; only the rows still running."""
        p = self.future.result()
        if self.rows is None:
            return p
        return SpeculativeProposals(
            proposal_token_ids=p.proposal_token_ids[self.rows],
            proposal_probs=None if p.proposal_probs is None else p.proposal_probs[self.rows],
            proposal_lens=p.proposal_lens[self.rows], fallback=p.fallback, ahead=p.ahead)


class OverlapPipeline:
    def __init__(self, propose: Callable[[ExecuteModelRequest], SpeculativeProposals],
                 make_request: Callable[[list], tuple[Any, ExecuteModelRequest]]):
        """make_request(seqs) -> (plan, request): what `_step` would send for them."""
        self._propose, self._make_request = propose, make_request
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="propose")
        self._next: Planned | None = None  # the other group, proposals in flight

    def in_flight(self, seq) -> bool:
        """Whether seq's proposals are being computed (release it after `settle`)."""
        return self._next is not None and any(s is seq for s in self._next.seqs)

    def busy(self) -> bool:
        return self._next is not None

    def take(self, running: list) -> tuple[list, Planned | None, list]:
        """This step's group: the one whose proposals are in flight (with them), else the
        first half of `running` (None: propose it now, then `prefetch` the rest); and the
        cancelled sequences whose in-flight call has returned, to be released now."""
        planned, self._next = self._next, None
        if planned is None:
            return running[:(len(running) + 1) // 2], None, []
        cancelled = [s for s in planned.seqs if s.finish_reason]
        if cancelled:
            planned.future.exception()  # wait: their call must be over before the release
            alive = [i for i, s in enumerate(planned.seqs) if not s.finish_reason]
            rows = alive if planned.rows is None else [planned.rows[i] for i in alive]
            planned = Planned([planned.seqs[i] for i in alive], planned.req.clone(
                [planned.req.seq_group_metadata_list[i] for i in alive]),
                dataclasses.replace(planned.plan, ks=[planned.plan.ks[i] for i in alive]),
                planned.future, rows)
        if not planned.seqs:
            return self.take(running)[:2] + (cancelled,)
        return planned.seqs, planned, cancelled

    def prefetch(self, seqs: list) -> None:
        """Request proposals for the other group (none when it is empty)."""
        if seqs:
            self._next = self._submit(seqs)

    def _submit(self, seqs: list) -> Planned:
        plan, req = self._make_request(seqs)
        ctx = contextvars.copy_context()  # the step span: the propose span is its child

        def propose() -> SpeculativeProposals:
            with tracing.child_span("propose_ahead", {"specdecode.batch_size": len(seqs),
                                                      "specdecode.k": req.num_lookahead_slots}):
                return self._propose(req)
        return Planned(seqs, req, plan, self._pool.submit(ctx.run, propose))
