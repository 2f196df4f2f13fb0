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
(specdecode.wire.delta_encoder).

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
from specdecode.telemetry import tracing
from specdecode.interfaces import SpeculativeProposals
from specdecode.serving.limits import MAX_K
from specdecode.sequence import ExecuteModelRequest, SequenceGroupMetadata

log = logging.getLogger(__name__)


@dataclass
class Ready:
    """A sequence's next proposal, drafted ahead from its real prefix of `length` tokens."""

    tokens: list[int]
    probs: torch.Tensor | None  # [len(tokens), V] the draft's distributions, or None
    length: int  # the prefix it continues: for the step right after its own only


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
    """A lookahead in flight: row i is drafted from seqs[i]'s first base[i] tokens plus
    assumed[i] (its proposals this step)."""

    seqs: list[Sequence]
    base: list[int]
    assumed: list[list[int]]
    guess: concurrent.futures.Future  # -> SpeculativeProposals, 1 per row, or None
    future: concurrent.futures.Future | None  # -> (rows, their proposals after the guess)
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

    def take(self, seq_id: int, k: int, length: int) -> Ready | None:
        """The proposal drafted ahead for the sequence, now `length` tokens long, at most k
        tokens (None: none is ready; one that k leaves unused is dropped, and so is one
        drafted from a shorter prefix: a plain step ran between, which never takes it)."""
        ready = self._ready.pop(seq_id, None)
        if ready is None:
            return None
        if ready.length != length:
            self.stats.wasted += len(ready.tokens)
            return None
        self.stats.wasted += max(len(ready.tokens) - k, 0)
        if k == 0 or not ready.tokens:
            return None
        probs = None if ready.probs is None else ready.probs[:k]
        return Ready(ready.tokens[:k], probs, length)

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
            length = sg.data.get_len()
            if not sg.is_prompt and (r := self.take(sg.seq_id, k, length)) is not None:
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
        step, the next step's k), on the worker thread, in this thread's context (deadline,
        step span): one call for the draft's guess of the target's token, from the row with
        its proposals appended, then one for the next proposal after the guess (so that a
        wrong guess is known, and the rest cancelled, as soon as the verify is back)."""
        rows = [r for r in rows if r[3] > 0]
        if not rows:
            return
        guess_req = ExecuteModelRequest(
            [dataclasses.replace(sg.with_appended(x), num_speculative_tokens=1)
             for _, sg, x, _ in rows], num_lookahead_slots=1, draft_ahead=True)
        ahead = _Ahead([s for s, *_ in rows], [len(s.token_ids) for s, *_ in rows],
                       [list(x) for _, _, x, _ in rows], concurrent.futures.Future(),
                       None, deadlines.Cancel())
        ctx = contextvars.copy_context()

        def follow(guesses: SpeculativeProposals) -> tuple[list[int], SpeculativeProposals] | None:
            """The next proposals, after each row's guess: (rows, their proposals)."""
            guessed = [i for i, (_, _, _, k) in enumerate(rows)
                       if guesses.proposal_lens[i] and min(k, MAX_K - 1)]
            if not guessed:
                return None
            groups = [dataclasses.replace(
                rows[i][1].with_appended([*rows[i][2], int(guesses.proposal_token_ids[i, 0])]),
                num_speculative_tokens=min(rows[i][3], MAX_K - 1)) for i in guessed]
            return guessed, self._propose(ExecuteModelRequest(
                groups, max(g.num_speculative_tokens for g in groups), draft_ahead=True))

        def draft():
            with tracing.child_span("draft_ahead", {"specdecode.batch_size": len(rows)}
                                    ) as span, deadlines.cancelled_by(ahead.cancel):
                try:
                    ahead.guess.set_result(self._propose(guess_req))
                    return follow(ahead.guess.result())
                except deadlines.CallCancelled:
                    tracing.set_attributes(span, {"specdecode.lookahead.cancelled": True})
                    return None
                finally:
                    if not ahead.guess.done():  # failed or cancelled before the guess
                        ahead.guess.set_result(None)
        ahead.future = self._pool.submit(ctx.run, draft)
        self._ahead = ahead

    def settle(self) -> None:
        """After the step's tokens were appended: each row a hit (its next proposal is
        kept) or a miss. A row may hit while every proposal it assumed was accepted and
        the target's token is its guess; the call is cancelled as soon as none may."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        real = [s.token_ids[b:] for s, b in zip(ahead.seqs, ahead.base)]  # [B] e, per row
        may = [_may_hit(s, e, x) for s, e, x in zip(ahead.seqs, real, ahead.assumed)]
        start = time.perf_counter()
        if not any(may):
            ahead.cancel.cancel()
        guesses = _wait(ahead.guess)
        self.stats.full += sum(may) if guesses is not None else 0
        may = [m and guesses is not None and _row(guesses, i) == [e[len(x)]]
               for i, (m, e, x) in enumerate(zip(may, real, ahead.assumed))]
        if not any(may):
            ahead.cancel.cancel()
        rest = _wait(ahead.future)
        self.stats.wait_s += time.perf_counter() - start
        chains = _chains(guesses, rest, len(ahead.seqs))
        for seq, hit, (tokens, probs) in zip(ahead.seqs, may, chains):
            self.stats.drafted += len(tokens)
            if not hit or len(tokens) < 2:  # a guess alone leaves nothing to propose
                self.stats.misses += 1
                self.stats.wasted += len(tokens)
                continue
            self.stats.hits += 1
            self._ready[seq.seq_id] = Ready(tokens[1:], None if probs is None else probs[1:],
                                            len(seq.token_ids))
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
        _wait(ahead.future)

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.cancel.cancel()
        self._pool.shutdown(wait=True)


def _may_hit(seq: Sequence, emitted: list[int], assumed: list[int]) -> bool:
    """Whether a row may still be a hit: running, and every proposal it assumed accepted."""
    return (seq.finish_reason is None and len(emitted) > len(assumed)
            and emitted[:len(assumed)] == assumed)


def _wait(future: concurrent.futures.Future):
    """A call's result, or None when it was cancelled, failed or proposed nothing."""
    try:
        result = future.result()
    except Exception as exc:  # a failed lookahead costs its hits, never the step
        log.warning("drafting ahead failed: %s", exc)
        return None
    if isinstance(result, SpeculativeProposals) and result.fallback == len(result.proposal_lens):
        return None
    return result


def _chains(guesses: SpeculativeProposals | None, rest, rows: int
            ) -> list[tuple[list[int], torch.Tensor | None]]:
    """Each row's tokens drafted ahead (its guess, then its next proposal) and their
    draft distributions [n, V] (None without probabilities)."""
    chains = [([], None)] * rows
    if guesses is None:
        return chains
    for i in range(rows):
        chains[i] = (_row(guesses, i), None if guesses.proposal_probs is None
                     else guesses.proposal_probs[i, :int(guesses.proposal_lens[i])])
    follow, proposals = rest if rest is not None else ([], None)
    for j, i in enumerate(follow):
        if proposals is None or proposals.fallback == len(follow):
            break
        tokens, probs = chains[i]
        more = _row(proposals, j)
        if probs is not None and proposals.proposal_probs is not None:
            probs = torch.cat([probs, proposals.proposal_probs[j, :len(more)]])
        chains[i] = (tokens + more, probs)
    return chains


def _row(proposals: SpeculativeProposals, i: int) -> list[int]:
    n = int(proposals.proposal_lens[i])
    return proposals.proposal_token_ids[i, :n].tolist()
