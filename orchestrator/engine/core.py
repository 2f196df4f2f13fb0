"""The step loop: every running sequence's step, in five phases a reader sees at once:

    plan        who joins (token budget, overlap group) and each sequence's k (the policy)
    propose     the proposer's draft tokens (a prompt chunk warms a draft model's KV state)
    score       the scorer's view of every proposal position and the bonus position
    verify      lossless rejection sampling: the tokens each sequence emits
    postprocess the stop rules, text, logprobs, usage and step statistics; tokens a grammar
                forces (jump-forward); release the finished

Iteration-level batching: requests added between steps join the next step; a sequence's
first step (its prompt has no KV state yet) is scored with proposal length 0. The engine
knows nothing of gRPC: the proposer and scorer may be in-process or remote clients, and it
trusts its requests (the frontend validated them once: orchestrator.frontend.request).

Tracing: each step is a `spec_decode.step` span with children `propose`, `score` and
`rejection_sample`, placed in the trace of the oldest participating request and linked to
the others (see specdecode.telemetry.tracing.step_span). `trace_every` keeps every Nth step span
(1 = all, 0 = none: request spans only).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import secrets
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from orchestrator.engine import deadlines
from orchestrator.engine.draft_warming import DraftWarming
from orchestrator.engine.lookahead import Lookahead
from orchestrator.engine.lookahead_pricing import LookaheadPricing
from orchestrator.engine.overlap import OverlapPipeline, Planned
from orchestrator.engine.postprocess import append_tokens, step_output
from orchestrator.engine.prefill_pacing import PrefillPacer
from orchestrator.engine.rejection_sampler import RejectionSampler
from orchestrator.engine.request import Request, Sequence, StepOutput
from orchestrator.engine.scheduler import plan_step, speculation_cap, tokens_left
from orchestrator.engine.service_stats import ServiceStats, snapshot, step_stats
from orchestrator.engine.speculation_policy import Candidate, Plan, SpeculationPolicy
from orchestrator.engine.step_stats import StepStats
from orchestrator.engine.verify import verify
from specdecode.telemetry import tracing
from specdecode.api.usage import Usage
from specdecode.interfaces import (SpeculativeProposals, SpeculativeProposer, SpeculativeScorer,
                                   SpeculativeScores)
from specdecode.errors import InvalidRequestError
from specdecode.grammar.matcher import Grammars
from specdecode.sequence import ExecuteModelRequest, SequenceData, SequenceGroupMetadata

log = logging.getLogger(__name__)


@dataclass
class Batch:
    """One step's participants: rows[i] = (sequence, prompt chunk), the chunk being the
    prompt prefix computed this step (None: the whole sequence)."""

    rows: list[tuple[Sequence, int | None]]
    planned: Planned | None = None  # overlap: its proposals were requested a step earlier

    @property
    def seqs(self) -> list[Sequence]:
        return [s for s, _ in self.rows]

    @property
    def chunks(self) -> list[int]:
        return [i for i, (_, chunk) in enumerate(self.rows) if chunk is not None]

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens computed this step."""
        return sum((len(s.request.prompt_token_ids) if c is None else c) - s.prefilled
                   for s, c in self.rows if not s.decoding)


class SpecDecodeEngine:
    def __init__(self, proposer: SpeculativeProposer, scorer: SpeculativeScorer, *,
                 max_model_len: int, num_speculative_tokens: int,
                 sampler: RejectionSampler | None = None, trace_every: int = 1,
                 policy: SpeculationPolicy | None = None,
                 max_num_batched_tokens: int | None = None, overlap: bool = False,
                 grammars: Grammars | None = None,
                 lookahead: LookaheadPricing | None = None, share_cores: bool = True):
        """policy: picks each sequence's k per step (default: fixed k, every sequence
        speculating num_speculative_tokens or its request's smaller value).
        grammars: the engine's own grammar states (structured output), for jump-forward:
        a token a sequence's grammar forces is appended with no forward at all.
        overlap: two groups of sequences alternate between proposer and scorer
        (orchestrator.engine.overlap); prompts then join whole (no chunked prefill).
        lookahead: draft ahead where it pays (orchestrator.engine.lookahead; None = off:
        lockstep), as the policy prices it (the policy holds the same object).
        max_num_batched_tokens: tokens one step may compute (None = no limit); longer
        prompts are prefilled in chunks across steps (see scheduler.plan_step).
        share_cores: the proposer's and the scorer's forwards compete for the same cores
        (specdecode.model_info.share_cores): a prompt chunk's draft call then runs before
        the scoring call, not beside it."""
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens: must be >= 0, got {num_speculative_tokens}")
        if trace_every < 0:
            raise ValueError(f"trace_every: must be >= 0, got {trace_every}")
        self.proposer, self.scorer = proposer, scorer
        self.max_model_len = max_model_len
        self.k = num_speculative_tokens
        self.sampler = sampler or RejectionSampler()
        self.policy = policy or SpeculationPolicy(num_speculative_tokens, adaptive=False)
        self.running: dict[str, Sequence] = {}
        self.last_step = StepStats()
        self.trace_every = trace_every
        self.max_num_batched_tokens = max_num_batched_tokens
        self.pacer = PrefillPacer()  # prompt tokens beside decoders (chunked prefill)
        self.grammars = grammars
        # One proposer call at a time: the step's, the warming's, the overlap's and the
        # lookahead's threads share it (an in-process proposer is not thread-safe; a service
        # serialises anyway).
        self._proposing = threading.Lock()
        self.warming = DraftWarming(self._call_proposer, share_cores, lambda seq: (
            self.policy.draft_model and self._cap(seq) > 0))
        self.ahead_pricing = lookahead
        self.lookahead = Lookahead(self._call_proposer) if lookahead is not None else None
        self.steps = 0  # steps run so far
        # Services key their KV caches by sequence id, and may serve several orchestrators:
        # ids carry a random 38-bit prefix of this engine and a 24-bit counter (below 2**62:
        # int64 on the wire, with room for batch expansion's max(id)+1... target ids).
        self.orchestrator_id = secrets.randbits(38)
        self._seq_ids = (self.orchestrator_id << 24 | n % (1 << 24) for n in itertools.count())
        self.pipeline = (OverlapPipeline(self._proposals, lambda seqs: self._plan(
            [(s, None) for s in seqs])) if overlap else None)

    # -- requests ------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Join the next step. On the engine's thread (it owns `running`)."""
        if request.request_id in self.running:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already running")
        self.running[request.request_id] = Sequence(
            next(self._seq_ids), request, stats=Usage(prompt_tokens=len(request.prompt_token_ids)))

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its sequence is released on both services."""
        seq = self.running.pop(request_id, None)
        if seq is not None:
            seq.finish_reason = "cancelled"
            if self.pipeline is None or not self.pipeline.in_flight(seq):
                self._release([seq])  # else once its proposals return (OverlapPipeline.take)
        return seq is not None

    def has_unfinished(self) -> bool:
        """Whether a step has work: a running sequence not paused, or proposals in flight."""
        return bool(self._active()) or (self.pipeline is not None and self.pipeline.busy())

    def _active(self) -> list[Sequence]:
        """The running sequences not paused (their clients' outputs are full: outbox)."""
        return [s for s in self.running.values() if not s.paused]

    def generate(self, requests: list[Request]) -> dict[str, Sequence]:
        """Run requests to completion together; returns the finished sequences by id."""
        done: dict[str, Sequence] = {}
        for r in requests:
            self.add_request(r)
        seqs = dict(self.running)
        while self.has_unfinished():
            for out in self.step():
                if out.finish_reason:
                    done[out.request_id] = seqs[out.request_id]
        return done

    # -- the step ------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """One step of the running sequences (within the token budget), or with overlap of
        one of the two groups."""
        batch = self._schedule()
        if not batch.rows:
            return []
        prompt_tokens = batch.prompt_tokens
        decoding = sum(1 for s in batch.seqs if s.decoding)
        index, self.steps = self.steps, self.steps + 1
        traced = self.trace_every > 0 and index % self.trace_every == 0
        with tracing.step_span("spec_decode.step",
                                 [(s.request.request_id, s.request.trace_context)
                                  for s in batch.seqs],
                                 traced, {"specdecode.step.index": index}) as span:
            outputs = self._run(batch)
            tracing.set_attributes(span, self.last_step.span_attributes())
        self.pacer.observe(self.last_step.total_s, prompt_tokens, decoding)
        return outputs

    def _run(self, batch: Batch) -> list[StepOutput]:
        start = time.perf_counter()
        counters = self._service_counters()
        prefill = any(not s.decoding for s in batch.seqs)  # a prompt (or chunk) is computed
        plan, req = ((batch.planned.plan, batch.planned.req) if batch.planned
                     else self._plan(batch.rows))
        k = req.num_lookahead_slots
        stats = StepStats(batch_size=len(batch.rows), k=k, chosen_k=list(plan.ks),
                          predicted_scoring=plan.scoring, explore=plan.explore,
                          k_reasons=list(plan.reasons), predicted_speedup=plan.speedup,
                          best_speculative_speedup=plan.best_speedup,
                          accepted_by_position=[0] * k)
        with deadlines.bounded_by(self._deadline(batch.seqs)):
            proposals, warming = self._propose(batch, req)
            stats.propose_s = time.perf_counter() - start
            self._draft_ahead(batch, plan, req, proposals)  # beside the scoring call
            scores = self._score(req, proposals, warming)
        stats.score_s = time.perf_counter() - start - stats.propose_s
        emitted, passed = self._verify(req, proposals, scores)
        stats.verify_s = time.perf_counter() - start - stats.propose_s - stats.score_s
        ran = k > 0 and not proposals.fallback  # the proposer read every sequence
        outputs = self._postprocess(batch, plan, proposals, scores, emitted, passed,
                                    (ran, self.warming.warmed(batch.rows, ran, warming)), stats)
        self._settle_ahead(stats)
        stats.total_s = time.perf_counter() - start
        log.debug("step: k %s (%s; predicted %.2fx plain, best %.2fx), proposed %s, emitted %d "
                  "of %d drafted; %.0f ms, predicted %.0f (propose %.0f, score %.0f)", plan.ks,
                  ",".join(plan.reasons), plan.speedup, plan.best_speedup,
                  proposals.proposal_lens.tolist(), stats.emitted_tokens, stats.draft_tokens,
                  1e3 * stats.total_s, 1e3 * plan.seconds, 1e3 * stats.propose_s,
                  1e3 * stats.score_s)
        stats.observe_services({role: step_stats(counters[role], after, stats.total_s)
                                for role, after in self._service_counters().items()})
        # A step whose proposer failed or timed out (orchestrator.cluster.fanout) says nothing
        # of the proposer's cost, nor one that computed a prompt of decode or verify costs:
        # their times are not learned.
        if (ran or not k) and not prefill:
            # Proposals drafted ahead cost the step no draft time: it teaches no draft cost.
            learn = dataclasses.replace(plan, ks=[0] * len(plan.ks)) if proposals.ahead else plan
            # A lookahead drafted beside the scoring call: the proposer's busy seconds hold
            # it too, so they say nothing of the step's own proposer call (its RPC, the call
            # less them, read negative on two hosts).
            ahead = stats.lookahead_hits + stats.lookahead_misses
            self.policy.observe_step(learn, proposals.proposal_lens.tolist(), stats.propose_s,
                                     stats.score_s, stats.total_s - stats.lookahead_wait_s,
                                     {role: s.busy_s for role, s in stats.services.items()
                                      if role != "proposer" or not ahead})
            self.policy.observe_outcome(plan, stats.total_s)
        self.last_step = stats
        return outputs

    # plan

    def _schedule(self) -> Batch:
        """Who joins this step: with overlap the group whose proposals are ready (or the
        first half), else every running sequence within the token budget."""
        if self.pipeline is not None:
            seqs, planned, cancelled = self.pipeline.take(self._active())
            self._release(cancelled)
            return Batch([(s, None) for s in seqs], planned)
        return Batch(plan_step(self._active(), self._cap,
                               self.max_num_batched_tokens, self.pacer.cap()))

    def _cap(self, seq: Sequence) -> int:
        return speculation_cap(seq, self.k, self.max_model_len)

    def _plan(self, rows: list[tuple[Sequence, int | None]]) -> tuple[Plan, ExecuteModelRequest]:
        """Each sequence's k (the policy's) and the step's request."""
        plan = self.policy.plan([
            Candidate(s.seq_id, 0 if c is not None else self._cap(s),
                      behind=max(len(s.token_ids) - s.drafted, 1),
                      remaining=tokens_left(s, self.max_model_len))
            for s, c in rows])
        return plan, ExecuteModelRequest(
            [self._group(s, n, c) for (s, c), n in zip(rows, plan.ks)],
            num_lookahead_slots=max(plan.ks, default=0))

    @staticmethod
    def _group(seq: Sequence, k: int, chunk: int | None) -> SequenceGroupMetadata:
        """Row of the step's request. A prompt (or its chunk, the prefix prompt[:chunk]) is
        a prompt row: scored with proposal length 0, and a draft model computes its KV state
        when it rides along a proposer call (it proposes nothing)."""
        prompt = seq.request.prompt_token_ids
        data = (SequenceData(prompt[:chunk]) if chunk is not None
                else SequenceData(prompt, list(seq.output_token_ids)))
        return SequenceGroupMetadata(
            request_id=seq.request.request_id, is_prompt=chunk is not None or not seq.decoding,
            seq_data={seq.seq_id: data}, sampling_params=seq.request.sampling_params,
            num_speculative_tokens=k)

    @staticmethod
    def _deadline(seqs: list[Sequence]) -> float | None:
        """The latest client deadline of the group (None when one has none)."""
        client_deadlines = [s.request.deadline for s in seqs]
        return None if None in client_deadlines else max(client_deadlines)

    # propose

    def _proposals(self, req: ExecuteModelRequest) -> SpeculativeProposals:
        """The rows' proposals: drafted ahead where ready, else from the proposer."""
        if req.num_lookahead_slots == 0:  # plain decoding: nothing to propose
            return SpeculativeProposals.none(len(req.seq_group_metadata_list))
        if self.lookahead is None:
            return self._call_proposer(req)
        return self.lookahead.proposals(req, self._call_proposer)

    def _call_proposer(self, req: ExecuteModelRequest) -> SpeculativeProposals:
        with self._proposing:
            return self.proposer.get_proposals(req)

    def _draft_ahead(self, batch: Batch, plan: Plan, req: ExecuteModelRequest,
                     proposals: SpeculativeProposals) -> None:
        """Draft the speculating rows' next proposals while this step is scored, when the
        plan was priced that way (or, unpriced, where the services share no cores)."""
        if self.lookahead is None or not (plan.ahead or (
                not self.policy.adaptive and self.ahead_pricing.unpriced())):
            return
        lens = proposals.proposal_lens.tolist()
        fit = LookaheadPricing.fit(plan, self.policy.draft_token_seconds(len(plan.ks)))
        self.lookahead.launch([
            (seq, sg, proposals.proposal_token_ids[i, :lens[i]].tolist(), min(k, fit))
            for i, ((seq, chunk), sg, k) in enumerate(zip(
                batch.rows, req.seq_group_metadata_list, plan.ks))
            # not a row this step may finish (its next proposal would go unused)
            if chunk is None and seq.decoding and k
            and tokens_left(seq, self.max_model_len) > lens[i] + 1])

    def _settle_ahead(self, stats: StepStats) -> None:
        """The lookahead's hits and misses, now that the step's tokens are known."""
        if self.lookahead is None:
            return
        self.lookahead.settle()
        ahead = self.lookahead.take_stats()
        stats.observe_lookahead(ahead)
        self.ahead_pricing.observe(ahead.full, ahead.hits)

    def _propose(self, batch: Batch, req: ExecuteModelRequest
                 ) -> tuple[SpeculativeProposals, Future | None]:
        """The step's proposals, and the background call that warms a draft model's KV
        state for the prompt chunks when nobody speculates (a step of its own would cost
        decoders a proposer round trip more: 3x a decode step on small models)."""
        k, warm = req.num_lookahead_slots, self.warming.rows(batch.rows)
        if batch.planned is None and k == 0:
            warming = self.warming.send(req, warm) if warm and self.k else None
            proposals = SpeculativeProposals.none(len(batch.rows))
        else:
            warming = None
            with tracing.child_span("propose", {"specdecode.batch_size": len(batch.rows),
                                                  "specdecode.k": k}) as span:
                proposals = batch.planned.proposals() if batch.planned else self._proposals(req)
                if span.is_recording():
                    span.set_attribute("specdecode.draft_tokens",
                                       int(proposals.proposal_lens.sum()))
        if self.pipeline is not None:  # the other group drafts while this one is scored
            taken = {id(s) for s in batch.seqs}
            rest = [s for s in self._active() if id(s) not in taken]
            with deadlines.bounded_by(self._deadline(rest) if rest else None):
                self.pipeline.prefetch(rest)
        return proposals, warming

    # score

    def _score(self, req: ExecuteModelRequest, proposals: SpeculativeProposals,
               warming: Future | None) -> SpeculativeScores:
        k = req.num_lookahead_slots
        with tracing.child_span("score", {"specdecode.batch_size": len(
                req.seq_group_metadata_list), "specdecode.k": k}):
            scores = self.scorer.score_proposals(req, proposals)
        if warming is not None:
            warming.result()  # raises what the proposer raised; it proposed nothing
        return scores

    # verify

    def _verify(self, req: ExecuteModelRequest, proposals: SpeculativeProposals,
                scores: SpeculativeScores) -> tuple[list[list[int]], list[int]]:
        with tracing.child_span("rejection_sample") as span:
            emitted, passed = verify(self.sampler, req, proposals, scores)
            tracing.set_attributes(span, {"specdecode.accepted_tokens": sum(passed)})
        return emitted, passed

    # postprocess

    def _postprocess(self, batch: Batch, plan: Plan, proposals: SpeculativeProposals,
                     scores: SpeculativeScores, emitted: list[list[int]], passed: list[int],
                     drafted: tuple[bool, set[int]], stats: StepStats) -> list[StepOutput]:
        """Append each sequence's tokens under the stop rules, count the step, learn its
        acceptance; release the sequences that finished. drafted: whether the proposer read
        the step's speculating and prompt rows, and the rows whose prompts (chunks, or whole
        prompts on two hosts) it was sent beside the scoring call (the draft's KV state)."""
        read, warmed = drafted
        outputs, finished = [], []
        for i, ((seq, chunk), tokens) in enumerate(zip(batch.rows, emitted)):
            if chunk is not None:  # a prompt chunk: its token is discarded
                seq.prefilled = chunk
                seq.drafted = chunk if i in warmed else seq.drafted
                continue
            n = int(proposals.proposal_lens[i])
            if (read or i in warmed) and (plan.ks[i] or not seq.decoding or i in warmed):
                # it read the sequence and its first n-1 proposals (warmed: the sequence)
                seq.drafted = len(seq.token_ids) + min(len(tokens) - 1, max(n - 1, 0))
            self.policy.observe(seq.seq_id, plan.ks[i], n, len(tokens) - 1 if n else 0)
            constrained = seq.request.sampling_params.structured_output is not None
            if n:
                stats.observe_draft(n, passed[i], len(tokens), constrained)
            elif plan.ks[i] and read:
                stats.k_reasons[i] = "no_match"  # asked, and the proposer found nothing
            seq.stats.observe_step(n, len(tokens))
            new = append_tokens(seq, tokens, self.max_model_len)
            # (a request that wants logprobs gets its forced tokens from forwards: the
            # model's log-probabilities of a token nothing computed are unknown)
            if (constrained and self.grammars is not None and not seq.finish_reason
                    and seq.request.sampling_params.logprobs is None):
                new += self._jump_forward(seq, stats)
            stats.new_tokens += len(new)
            logprobs = None if scores.logprobs is None else scores.logprobs[i]
            outputs.append(step_output(seq, new, logprobs))
            if seq.finish_reason:
                finished.append(seq)
        for seq in finished:
            del self.running[seq.request.request_id]
        self._release(finished)
        stats.finished = len(finished)
        return outputs

    def _jump_forward(self, seq: Sequence, stats: StepStats) -> list[int]:
        """Append the tokens the sequence's grammar forces next (each the only one its mask
        allows: the target's masked distribution is a point mass there), with no forward,
        under the stop rules. The services see them as output in the next step."""
        start = time.perf_counter()
        matcher = self.grammars.matcher(seq.seq_id, seq.request.sampling_params.structured_output)
        forced: list[int] = []
        while not seq.finish_reason and matcher.sync(seq.output_token_ids):
            token = matcher.forced_token()
            if token is None:
                break
            forced += append_tokens(seq, [token], self.max_model_len)
        stats.forced_tokens += len(forced)
        self.grammars.stats.forced += len(forced)
        stats.grammar_s += time.perf_counter() - start
        return forced

    def _service_counters(self) -> dict[str, ServiceStats]:
        """Cumulative counters of the remote services (zeros in-process)."""
        return {"proposer": snapshot(self.proposer), "scorer": snapshot(self.scorer)}

    def _release(self, seqs: list[Sequence]) -> None:
        """Release on both services; one failing never keeps the other's release back."""
        if seqs:
            if self.lookahead is not None:
                self.lookahead.quiesce(seqs)  # no lookahead call re-creates their state
            ids = [s.seq_id for s in seqs]
            self.policy.forget(ids)
            if self.grammars is not None:
                self.grammars.release(ids)
            for service in (self.proposer, self.scorer):
                try:
                    service.release_sequences(ids)
                except Exception as exc:  # the service's cache evicts them in time
                    log.warning("releasing %d sequences on %s failed: %s", len(ids),
                                type(service).__name__, exc)
