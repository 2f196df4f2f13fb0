"""Asynchronous drafting: while the scorer verifies a step's proposals, the proposer drafts
beyond them, so that with two hosts the draft's steps leave the critical path
(docs/design.md, *Asynchronous drafting*).

    step t:   score R + x1..xk   ‖   draft ahead from R + x1..xk: g y1 .. ym
    settle:   the sequence is now R + e (e: the tokens step t emitted). The drafted chain
              x1..xk g y1..ym was drafted token by token from its own prefix, so where e is
              a prefix of it, the chain's next tokens were drafted from the real prefix:
              e = x1..xk g (every proposal accepted, the target's token = the draft's guess
              g of it) leaves y1..ym as step t+1's proposal (a hit); anything else is a miss,
              and the chain is dropped (its call stopped on the wire if still running).

A chain token is used only when the prefix it was drafted from is the sequence's real
prefix, so it is a draw from the draft's distribution given that prefix, as a proposal
drafted then would be; the rejection sampler sees its probabilities. Seeded draws depend on
(seed, position, role) only (specdecode.sampling.step_generator), so a seeded request gives
the same tokens with lookahead on and off when the steps' k are the same. The draft's KV
state for a dropped chain is rolled back by the next call (its prefix no longer matches,
docs/design.md invariant 3), and the proposer's delta record likewise
(specdecode.deltas.encoder).

The lookahead call goes out beside the scoring call and is settled once the step's tokens
are appended, so no call of it outlives its step: the next step's fresh proposer call never
queues behind it, a release waits for it (`quiesce`), and a proposer that fails during it
costs the hits only (the step already has its proposals). A chain is at most MAX_K tokens
(the services' per-call bound): at k = MAX_K a hit's proposal is one token short.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from orchestrator.engine import deadlines
from orchestrator.engine.request import Sequence
from specdecode import tracing
from specdecode.interfaces import SpeculativeProposals
from specdecode.limits import MAX_K
from specdecode.sequence import ExecuteModelRequest, SequenceGroupMetadata

log = logging.getLogger(__name__)


@dataclass
class Ready:
    """A sequence's next proposal, drafted ahead from its real prefix."""

    tokens: list[int]
    probs: torch.Tensor | None  # [len(tokens), V] the draft's distributions, or None


@dataclass
class AheadStats:
    """One step's lookahead: rows settled as hits / misses, chain tokens drafted ahead, and
    of those, dropped (a miss's, or a hit's beyond the next step's k); the seconds the step
    waited for the call after its own tokens were known."""

    hits: int = 0
    misses: int = 0
    full: int = 0  # rows whose every proposal was accepted (a hit needs the guess too)
    drafted: int = 0
    wasted: int = 0
    ready: int = 0  # rows whose proposals this step had been drafted ahead
    wait_s: float = 0.0


@dataclass
class _Ahead:
    """A lookahead call in flight: row i is drafted from seqs[i]'s first base[i] tokens plus
    assumed[i] (its proposals this step)."""

    seqs: list[Sequence]
    base: list[int]
    assumed: list[list[int]]
    future: concurrent.futures.Future  # -> SpeculativeProposals, row per seq
    cancel: deadlines.Cancel


class Lookahead:
    def __init__(self, propose: Callable[[ExecuteModelRequest], SpeculativeProposals]):
        """propose(req): the proposer call (made on this object's worker thread)."""
        self._propose = propose
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="draft-ahead")
        self._ahead: _Ahead | None = None
        self._ready: dict[int, Ready] = {}  # seq id -> its next proposal (a hit)
        self.stats = AheadStats()  # of the step being run; the engine takes it (`take_stats`)

    # -- a step's proposals ----------------------------------------------------------------

    def take(self, seq_id: int, k: int) -> Ready | None:
        """The sequence's proposal drafted ahead, at most k tokens (None: none is ready; one
        that k leaves unused is dropped)."""
        ready = self._ready.pop(seq_id, None)
        if ready is None:
            return None
        self.stats.wasted += max(len(ready.tokens) - k, 0)
        if k == 0 or not ready.tokens:
            return None
        probs = None if ready.probs is None else ready.probs[:k]
        return Ready(ready.tokens[:k], probs)

    def proposals(self, req: ExecuteModelRequest,
                  propose: Callable[[ExecuteModelRequest], SpeculativeProposals]
                  ) -> SpeculativeProposals:
        """The step's proposals: a row's drafted ahead where one is ready, the other rows'
        (those that speculate, and prompt rows) from one `propose` call (none when every
        such row is ready)."""
        groups, K = req.seq_group_metadata_list, req.num_lookahead_slots
        ready = {}
        for i, sg in enumerate(groups):
            k = K if sg.num_speculative_tokens is None else min(sg.num_speculative_tokens, K)
            if not sg.is_prompt and (r := self.take(sg.seq_id, k)) is not None:
                ready[i] = r
        if not ready:
            return propose(req)
        B = len(groups)
        ids = torch.full((B, K), -1, dtype=torch.long)
        lens = torch.zeros(B, dtype=torch.long)
        fresh = [i for i, sg in enumerate(groups) if i not in ready
                 and (sg.is_prompt or sg.num_speculative_tokens != 0)]
        part = propose(req.clone([groups[i] for i in fresh])) if fresh else None
        vocab = next((r.probs.shape[-1] for r in ready.values() if r.probs is not None),
                     None if part is None or part.proposal_probs is None
                     else part.proposal_probs.shape[-1])
        probs = None if vocab is None else torch.zeros(B, K, vocab)
        if part is not None:
            ids[fresh], lens[fresh] = part.proposal_token_ids, part.proposal_lens
            if part.proposal_probs is not None:
                probs[fresh] = part.proposal_probs
        for i, r in ready.items():
            ids[i, :len(r.tokens)], lens[i] = torch.tensor(r.tokens), len(r.tokens)
            if r.probs is not None:
                probs[i, :len(r.tokens)] = r.probs
        self.stats.ready += len(ready)
        return SpeculativeProposals(ids, probs, lens, part.fallback if part else 0, len(ready))

    # -- drafting ahead --------------------------------------------------------------------

    def launch(self, rows: list[tuple[Sequence, SequenceGroupMetadata, list[int], int]]) -> None:
        """Draft ahead for rows (sequence, its row of the step's request, its proposals this
        step, the next step's k): 1 + k tokens from the row with its proposals appended
        (the draft's guess of the target's token, then the next proposal), on the worker
        thread, in this thread's context (deadline, step span)."""
        rows = [r for r in rows if r[3] > 0]
        if not rows:
            return
        asked = [min(1 + k, MAX_K) for *_, k in rows]
        req = ExecuteModelRequest(
            [dataclasses.replace(sg.with_appended(x), num_speculative_tokens=m)
             for (_, sg, x, _), m in zip(rows, asked)], num_lookahead_slots=max(asked),
            draft_ahead=True)
        cancel = deadlines.Cancel()
        ctx = contextvars.copy_context()

        def draft() -> SpeculativeProposals | None:  # None: cancelled
            with tracing.child_span("draft_ahead", {"specdecode.batch_size": len(rows),
                                                    "specdecode.k": req.num_lookahead_slots}
                                    ) as span, deadlines.cancelled_by(cancel):
                try:
                    return self._propose(req)
                except deadlines.CallCancelled:
                    tracing.set_attributes(span, {"specdecode.lookahead.cancelled": True})
                    return None
        self._ahead = _Ahead([s for s, *_ in rows], [len(s.token_ids) for s, *_ in rows],
                             [list(x) for _, _, x, _ in rows],
                             self._pool.submit(ctx.run, draft), cancel)

    def settle(self) -> None:
        """After the step's tokens were appended: each row a hit (its next proposal is
        kept) or a miss. Waits for the call when some row may hit (every proposal of it
        accepted so far), else cancels it."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        real = [s.token_ids[b:] for s, b in zip(ahead.seqs, ahead.base)]  # [B] e, per row
        if not any(_may_hit(s, e, x) for s, e, x in zip(ahead.seqs, real, ahead.assumed)):
            ahead.cancel.cancel()
        start = time.perf_counter()
        proposals = _result(ahead)
        self.stats.wait_s += time.perf_counter() - start
        for i, (seq, e, x) in enumerate(zip(ahead.seqs, real, ahead.assumed)):
            chain = [] if proposals is None else _row(proposals, i)
            self.stats.drafted += len(chain)
            full = x + chain  # the chain as drafted, from the row's base
            may_hit = proposals is not None and _may_hit(seq, e, x)
            self.stats.full += may_hit
            hit = may_hit and len(e) < len(full) and full[:len(e)] == e
            if not hit:
                self.stats.misses += 1
                self.stats.wasted += len(chain)
                continue
            self.stats.hits += 1
            used = len(e) - len(x)  # chain tokens now part of the sequence (its guess g)
            probs = (None if proposals.proposal_probs is None
                     else proposals.proposal_probs[i, used:len(chain)])
            self._ready[seq.seq_id] = Ready(chain[used:], probs)
            # The draft read the chain up to its last token: it holds the new prefix.
            seq.drafted = max(seq.drafted, len(seq.token_ids))

    def take_stats(self) -> AheadStats:
        stats, self.stats = self.stats, AheadStats()
        return stats

    # -- releases --------------------------------------------------------------------------

    def in_flight(self, seq: Sequence) -> bool:
        return self._ahead is not None and any(s is seq for s in self._ahead.seqs)

    def quiesce(self, seqs: list[Sequence]) -> None:
        """Before `seqs` are released: their drafted proposals are dropped, and a lookahead
        call that has any of them in flight has returned (cancelled when no other row of it
        may still hit), so that no call re-creates their state on the proposer after the
        release."""
        for seq in seqs:
            ready = self._ready.pop(seq.seq_id, None)
            if ready is not None:
                self.stats.wasted += len(ready.tokens)
        ahead = self._ahead
        if ahead is None or not any(self.in_flight(s) for s in seqs):
            return
        gone = {id(s) for s in seqs}
        if all(id(s) in gone or s.finish_reason for s in ahead.seqs):
            ahead.cancel.cancel()
        _result(ahead)

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.cancel.cancel()
        self._pool.shutdown(wait=True)


def _may_hit(seq: Sequence, emitted: list[int], assumed: list[int]) -> bool:
    """Whether a row may still be a hit: running, and every proposal it assumed accepted."""
    return (seq.finish_reason is None and len(emitted) > len(assumed)
            and emitted[:len(assumed)] == assumed)


def _result(ahead: _Ahead) -> SpeculativeProposals | None:
    """The call's proposals, or None when it was cancelled, failed or proposed nothing."""
    try:
        proposals = ahead.future.result()
    except Exception as exc:  # a failed lookahead costs its hits, never the step
        log.warning("drafting ahead failed: %s", exc)
        return None
    return None if proposals is None or proposals.fallback == len(ahead.seqs) else proposals


def _row(proposals: SpeculativeProposals, i: int) -> list[int]:
    n = int(proposals.proposal_lens[i])
    return proposals.proposal_token_ids[i, :n].tolist()
