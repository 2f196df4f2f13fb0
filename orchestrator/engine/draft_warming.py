"""Prompts to the draft beside the target's prefill (docs/design.md, chunked prefill and
*Asynchronous drafting*): a step that speculates nothing sends its prompt chunks -- and, where
the services share no cores, its whole prompts and the decoding rows that may speculate
later -- to the proposer with k = 0, so a draft model computes their KV state and a
sequence's next speculative step has nothing to catch up. Where the services share cores the
call runs before the scoring call, not beside it. Every row sent is a prompt row to the
proposer: it computes the KV state of the tokens it lacks and proposes nothing."""

from __future__ import annotations

import contextvars
import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from specdecode.sequence import ExecuteModelRequest
from specdecode.telemetry import tracing


class DraftWarming:
    def __init__(self, propose: Callable[[ExecuteModelRequest], object], share_cores: bool,
                 keep_up: Callable[[object], bool]):
        """propose: the engine's proposer call; share_cores: the proposer's and the scorer's
        forwards compete for the same cores (specdecode.model_info.share_cores); keep_up:
        whether a decoding sequence's draft state is worth keeping current (a draft model,
        and the sequence may speculate)."""
        self.propose, self.share_cores, self.keep_up = propose, share_cores, keep_up
        self._thread: ThreadPoolExecutor | None = None

    def rows(self, rows: list[tuple[object, int | None]]) -> list[int]:
        """Rows (sequence, chunk) whose tokens the draft computes beside the scorer's:
        chunks, and where the services share no cores whole prompts and decoding rows
        (keep_up) too -- on two hosts the draft's core is idle while the target decodes:
        its prefill then costs nothing, where it followed the target's (a 97-token prompt:
        1.95 s, then the draft's catch-up 0.68 s, 41% of a 32-token request), and a
        sequence that decoded plainly for 30 steps speculates again without a 30-token
        catch-up (priced in, it kept Q&A plain after a prose request: 0.92x fixed k=2)."""
        return [i for i, (seq, chunk) in enumerate(rows)
                if chunk is not None or not self.share_cores and (
                    not seq.decoding or self.keep_up(seq))]

    def send(self, req: ExecuteModelRequest, rows: list[int]) -> Future:
        """Send rows `rows` of req to the proposer: in the background, in this thread's
        context (deadline, trace), where the services have cores of their own; else now
        (the Future returned is done). Two forwards on the same cores slow each other far
        more than one after the other costs: on 2 shared cores a 16-token chunk's step took
        ~80 ms beside the draft's, ~12 ms after it (the long-prompt join, tests/integration)."""
        warm = ExecuteModelRequest([dataclasses.replace(req.seq_group_metadata_list[i],
                                                        is_prompt=True) for i in rows])

        def call() -> None:
            with tracing.child_span("propose", {"specdecode.batch_size": len(rows),
                                                  "specdecode.k": 0}):
                self.propose(warm)

        if self.share_cores:
            done: Future = Future()
            done.set_result(call())
            return done
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="draft-chunks")
        return self._thread.submit(contextvars.copy_context().run, call)

    def warmed(self, rows: list[tuple[object, int | None]], ran: bool,
               warming: Future | None) -> set[int]:
        """Rows whose tokens (or chunk) the draft computed this step: the chunks riding
        along the proposer's call (`ran`), or those `send` sent."""
        if ran:
            return {i for i, (_, chunk) in enumerate(rows) if chunk is not None}
        return set(self.rows(rows)) if warming is not None else set()
