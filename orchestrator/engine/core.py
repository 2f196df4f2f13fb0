"""The step loop: propose, score, verify for every running sequence, then append and stop.

Iteration-level batching: requests added between steps join the next step; a sequence's
first step (its prompt has no KV state yet) is scored with proposal length 0. The engine
knows nothing of gRPC: the proposer and scorer may be in-process or remote clients.

Tracing: each step is a `spec_decode.step` span with children `propose`, `score` and
`rejection_sample`, placed in the trace of the oldest participating request and linked to
the others (see specdecode.tracing.step_span). `trace_every` keeps every Nth step span
(1 = all, 0 = none: request spans only).
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import secrets
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from orchestrator.engine import deadlines
from orchestrator.engine.overlap import OverlapPipeline, Planned
from orchestrator.engine.prefill_pacing import MIN_CHUNK, PrefillPacer
from orchestrator.engine.rejection_sampler import RejectionSampler
from orchestrator.engine.service_stats import ServiceStats, snapshot, step_stats
from orchestrator.engine.speculation_policy import Candidate, Plan, SpeculationPolicy
from specdecode import tracing
from specdecode.api.usage import Usage
from specdecode.interfaces import (SpeculativeProposals, SpeculativeProposer, SpeculativeScorer,
                                   SpeculativeScores)
from specdecode.sampling import step_generator
from specdecode.sequence import (ExecuteModelRequest, InvalidRequestError, SamplingParams,
                                 SequenceData, SequenceGroupMetadata, validate_token_ids)

log = logging.getLogger(__name__)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    num_speculative_tokens: int | None = None  # None = the engine's k; 0 = no speculation
    # The OpenTelemetry context of the request's span, carried explicitly to the engine
    # thread (contextvars do not cross threads); None when the request is not traced.
    trace_context: Any = field(default=None, repr=False, compare=False)
    # The client's deadline (time.monotonic()), or None: internal calls never outlive it.
    deadline: float | None = None


@dataclass
class Sequence:
    seq_id: int
    request: Request
    output_token_ids: list[int] = field(default_factory=list)
    # Its usage so far; accepted_tokens counts the draft tokens it received (each speculative
    # step's accepted prefix), so accepted_tokens <= emitted_tokens - speculative steps (the
    # step metrics also count, as vLLM 0.4.2 does, draft tokens that passed the accept test
    # after an earlier rejection: StepStats.accepted_tokens).
    stats: Usage = field(default_factory=Usage)
    finish_reason: str | None = None  # "stop" | "length" | "cancelled"
    # Prompt tokens the services already hold from earlier chunks (chunked prefill).
    prefilled: int = 0
    # Tokens whose KV state a draft model holds, as far as the proposer calls tell: what
    # it was sent, plus its own proposals that were accepted (the policy's catch-up).
    drafted: int = 0

    @property
    def token_ids(self) -> list[int]:
        return [*self.request.prompt_token_ids, *self.output_token_ids]


@dataclass
class TokenLogprobs:
    """The target model's log-probabilities at one emitted position (before any sampling
    control: the model's own distribution)."""

    token_id: int
    logprob: float  # of token_id
    top: list[tuple[int, float]]  # the n most likely (token id, logprob), most likely first


@dataclass
class StepOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    stats: Usage  # the sequence's usage, as of this output
    # One per new token when the request asked for logprobs, else None.
    logprobs: list[TokenLogprobs] | None = None


def token_logprobs(logprobs: torch.Tensor, token_ids: list[int], n: int) -> list[TokenLogprobs]:
    """logprobs [k+1, V] of one sequence's step, token_ids[j] emitted at position j ->
    each token's log-probability and the n most likely at its position."""
    rows = logprobs[:len(token_ids)].float()  # [T, V]
    top = rows.topk(n, dim=-1) if n else None
    out = []
    for j, t in enumerate(token_ids):
        best = [] if top is None else list(zip(top.indices[j].tolist(), top.values[j].tolist()))
        out.append(TokenLogprobs(t, float(rows[j, t]), best))
    return out


@dataclass
class StepStats:
    """One step, for metrics and traces: the one place acceptance is counted (the Prometheus
    metrics and vLLM 0.4.2's collector both read it, see orchestrator.engine.step_metrics)."""

    batch_size: int = 0
    k: int = 0  # the step's longest speculation (num_lookahead_slots)
    ks: list[int] = field(default_factory=list)  # [B] speculation length chosen per sequence
    scoring: str = ""  # the scoring method the policy's costs predicted ("" = not predicted)
    explore: bool = False  # the policy speculated to measure a cost, not because it pays
    draft_tokens: int = 0
    # Draft tokens that passed the accept test, even after an earlier rejection in their row
    # (vLLM 0.4.2's accepted_tokens: an alignment measure; may exceed what was emitted).
    accepted_tokens: int = 0
    emitted_tokens: int = 0  # accepted prefix + 1, summed over speculating sequences
    spec_sequences: int = 0
    # [k]: how many sequences emitted draft position j as an accepted token.
    accepted_by_position: list[int] = field(default_factory=list)
    new_tokens: int = 0  # tokens appended to outputs (after stop rules)
    finished: int = 0  # sequences that finished this step
    propose_s: float = 0.0
    score_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    bytes_sent: int = 0  # to the proposer and scorer (remote services only)
    bytes_received: int = 0
    services: dict[str, ServiceStats] = field(default_factory=dict)  # by role


def verify(sampler: RejectionSampler, req: ExecuteModelRequest,
           proposals: SpeculativeProposals,
           scores: SpeculativeScores) -> tuple[list[list[int]], list[int]]:
    """Tokens each sequence emits this step, and how many of its draft tokens passed the
    accept test (vLLM 0.4.2's accepted count; 0 for non-speculating sequences)."""
    groups = req.seq_group_metadata_list
    lens = proposals.proposal_lens  # [B]
    emitted: list[list[int]] = [[int(scores.token_ids[i, 0])] for i in range(len(groups))]
    accepted = [0] * len(groups)
    greedy = [i for i, sg in enumerate(groups) if lens[i] > 0 and sg.sampling_params.greedy]
    sampled = [i for i, sg in enumerate(groups) if lens[i] > 0 and not sg.sampling_params.greedy]
    k = req.num_lookahead_slots
    if greedy:
        out, passed = sampler.greedy(scores.token_ids[greedy],
                                     proposals.proposal_token_ids[greedy])
        for i, row, n in zip(greedy, out.tolist(), passed.tolist()):
            emitted[i], accepted[i] = [t for t in row if t != -1], n
    if sampled:
        rows = torch.tensor(sampled)
        bonus = scores.token_ids[rows].gather(1, lens[rows].unsqueeze(1))  # [S, 1] at n_i
        gens = [step_generator(groups[i].sampling_params, groups[i].data.get_len(), "verify")
                for i in sampled]
        draft_probs = None if proposals.proposal_probs is None else proposals.proposal_probs[rows]
        out, passed = sampler(scores.probs[rows, :k], bonus, draft_probs,
                              proposals.proposal_token_ids[rows], generators=gens)
        for i, row, n in zip(sampled, out.tolist(), passed.tolist()):
            emitted[i], accepted[i] = [t for t in row if t != -1], n
    return emitted, accepted


def plan_step(seqs: list[Sequence], k_of: Callable[[Sequence], int],
              budget: int | None, paced: int | None = None) -> list[tuple[Sequence, int | None]]:
    """Who joins this step, within a budget of tokens to compute (chunked prefill).

    Sequences that are decoding always join (k + 1 tokens each), so a running stream never
    waits. Prompts share what is left, in arrival order: a prompt that fits joins whole
    (None); a longer one sends its next chunk, a longer prefix of itself (the prefix
    length), whose output is discarded; the services keep its KV state, so the next chunk
    and finally the whole prompt reuse it. The first prompt always gets at least a quarter
    of the budget, so prompts progress however busy the decoding is. Beside decoding
    sequences, prompts get at most `paced` tokens in all (orchestrator.engine.prefill_pacing:
    what keeps the step's time near a decode step's)."""
    if budget is None:
        return [(s, None) for s in seqs]
    plan: list[tuple[Sequence, int | None]] = []
    left = budget
    prompts = []
    for s in seqs:
        if s.output_token_ids:
            plan.append((s, None))
            left -= k_of(s) + 1
        else:
            prompts.append(s)
    if plan and paced is not None:
        left = min(left, paced)
    for i, s in enumerate(prompts):
        todo = len(s.request.prompt_token_ids) - s.prefilled  # tokens not yet computed
        share = max(left, min(budget // 4, paced or budget)) if i == 0 else left
        if todo <= share:
            plan.append((s, None))
        elif share >= MIN_CHUNK:
            plan.append((s, s.prefilled + share))
        else:
            break  # later prompts wait their turn
        left -= min(todo, share)
    return plan


class SpecDecodeEngine:
    def __init__(self, proposer: SpeculativeProposer, scorer: SpeculativeScorer, *,
                 vocab_size: int, max_model_len: int, num_speculative_tokens: int,
                 sampler: RejectionSampler | None = None, trace_every: int = 1,
                 policy: SpeculationPolicy | None = None,
                 max_num_batched_tokens: int | None = None, overlap: bool = False):
        """policy: picks each sequence's k per step (default: fixed k, every sequence
        speculating num_speculative_tokens or its request's smaller value).
        overlap: two groups of sequences alternate between proposer and scorer
        (orchestrator.engine.overlap); prompts then join whole (no chunked prefill).
        max_num_batched_tokens: tokens one step may compute (None = no limit); longer
        prompts are prefilled in chunks across steps (see plan_step)."""
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens: must be >= 0, got {num_speculative_tokens}")
        if trace_every < 0:
            raise ValueError(f"trace_every: must be >= 0, got {trace_every}")
        self.proposer, self.scorer = proposer, scorer
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.k = num_speculative_tokens
        self.sampler = sampler or RejectionSampler()
        self.policy = policy or SpeculationPolicy(num_speculative_tokens, adaptive=False)
        self.running: dict[str, Sequence] = {}
        self.last_step = StepStats()
        self.trace_every = trace_every
        self.max_num_batched_tokens = max_num_batched_tokens
        self.pacer = PrefillPacer()  # prompt tokens beside decoders (chunked prefill)
        self._warmer: ThreadPoolExecutor | None = None  # chunks' draft calls (_warm_draft)
        self.steps = 0  # steps run so far
        # Services key their KV caches by sequence id, and may serve several orchestrators:
        # ids carry a random 38-bit prefix of this engine and a 24-bit counter (below 2**62:
        # int64 on the wire, with room for batch expansion's max(id)+1... target ids).
        self.orchestrator_id = secrets.randbits(38)
        self._seq_ids = (self.orchestrator_id << 24 | n % (1 << 24) for n in itertools.count())
        self.pipeline = (OverlapPipeline(self._propose, lambda seqs: self._plan_request(
            [(s, None) for s in seqs])) if overlap else None)

    # -- requests ------------------------------------------------------------------------

    def validate(self, request: Request) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        validate_token_ids(request.prompt_token_ids, [], self.vocab_size, self.max_model_len,
                           "prompt")
        if request.num_speculative_tokens is not None and request.num_speculative_tokens < 0:
            raise InvalidRequestError("num_speculative_tokens",
                                      f"must be >= 0, got {request.num_speculative_tokens}")
        request.sampling_params.validate(self.vocab_size)
        if request.request_id in self.running:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already running")

    def add_request(self, request: Request) -> None:
        self.validate(request)
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
        return bool(self.running) or (self.pipeline is not None and self.pipeline.busy())

    # -- the step ------------------------------------------------------------------------

    def _group(self, seq: Sequence, k: int, chunk: int | None = None) -> SequenceGroupMetadata:
        if chunk is not None:
            # A prompt chunk: the prefix prompt[:chunk], scored with proposal length 0.
            # It asks the proposer for one draft token (discarded) so that a draft model
            # computes its KV state for the chunk too (a prompt proposes nothing).
            return SequenceGroupMetadata(
                request_id=seq.request.request_id, is_prompt=False,
                seq_data={seq.seq_id: SequenceData(seq.request.prompt_token_ids[:chunk])},
                sampling_params=seq.request.sampling_params,
                num_speculative_tokens=min(1, self.k))
        return SequenceGroupMetadata(
            request_id=seq.request.request_id, is_prompt=not seq.output_token_ids,
            seq_data={seq.seq_id: SequenceData(seq.request.prompt_token_ids,
                                               list(seq.output_token_ids))},
            sampling_params=seq.request.sampling_params, num_speculative_tokens=k)

    def _cap(self, seq: Sequence) -> int:
        """The most `seq` may speculate: 0 on its prompt step (no KV state yet), else the
        server's k, lowered by the request's own value and by the room left for k proposals
        plus the bonus token."""
        if not seq.output_token_ids:
            return 0
        own = seq.request.num_speculative_tokens
        k = self.k if own is None else min(own, self.k)
        return max(0, min(k, self.max_model_len - len(seq.token_ids) - 1))

    def _warm_draft(self, req: ExecuteModelRequest, chunks: list[int]) -> Future:
        """Send the prompt chunks (rows `chunks` of req) to the proposer in the background,
        in this thread's context (deadline, trace): a draft model computes their KV state."""
        warm = ExecuteModelRequest([req.seq_group_metadata_list[i] for i in chunks],
                                   num_lookahead_slots=1)

        def call() -> None:
            with tracing.child_span("propose", {"specdecode.batch_size": len(chunks),
                                                  "specdecode.k": 1}):
                self.proposer.get_proposals(warm)

        if self._warmer is None:
            self._warmer = ThreadPoolExecutor(1, thread_name_prefix="draft-chunks")
        return self._warmer.submit(contextvars.copy_context().run, call)

    def _service_counters(self) -> dict[str, ServiceStats]:
        """Cumulative counters of the remote services (zeros in-process)."""
        return {"proposer": snapshot(self.proposer), "scorer": snapshot(self.scorer)}

    def step(self) -> list[StepOutput]:
        """One step: the running sequences (within the token budget), or with overlap one
        of the two groups."""
        planned = None
        if self.pipeline is not None:
            seqs, planned, cancelled = self.pipeline.take(list(self.running.values()))
            self._release(cancelled)
            plan = [(s, None) for s in seqs]
        else:
            plan = plan_step(list(self.running.values()), self._cap,
                             self.max_num_batched_tokens, self.pacer.cap())
        if not plan:
            return []
        seqs = [s for s, _ in plan]
        prompt_tokens = sum((len(s.request.prompt_token_ids) if c is None else c) - s.prefilled
                            for s, c in plan if not s.output_token_ids)
        decoding = sum(1 for s in seqs if s.output_token_ids)
        index, self.steps = self.steps, self.steps + 1
        traced = self.trace_every > 0 and index % self.trace_every == 0
        with tracing.step_span("spec_decode.step",
                                 [(s.request.request_id, s.request.trace_context) for s in seqs],
                                 traced, {"specdecode.step.index": index}) as span:
            outputs = self._step(plan, planned)
            stats = self.last_step
            tracing.set_attributes(span, {
                "specdecode.batch_size": stats.batch_size, "specdecode.k": stats.k,
                "specdecode.chosen_k": stats.ks,
                "specdecode.predicted_scoring": stats.scoring or None,
                "specdecode.explore": stats.explore,
                "specdecode.draft_tokens": stats.draft_tokens,
                "specdecode.accepted_tokens": stats.accepted_tokens,
                "specdecode.emitted_tokens": stats.emitted_tokens,
                "specdecode.spec_sequences": stats.spec_sequences,
                "specdecode.new_tokens": stats.new_tokens,
                "specdecode.finished": stats.finished,
                "specdecode.wire.bytes_sent": stats.bytes_sent,
                "specdecode.wire.bytes_received": stats.bytes_received,
                **{f"specdecode.{role}.{name}": value for role, service in stats.services.items()
                   for name, value in vars(service).items()}})
        self.pacer.observe(stats.total_s, prompt_tokens, decoding)
        return outputs

    def _plan_request(self, step_plan: list[tuple[Sequence, int | None]],
                      ) -> tuple[Plan, ExecuteModelRequest]:
        """Each sequence's k (the policy's) and the step's request."""
        plan = self.policy.plan([
            Candidate(s.seq_id, 0 if c is not None else self._cap(s),
                      behind=max(len(s.token_ids) - s.drafted, 1),
                      remaining=min(s.request.sampling_params.max_tokens - len(s.output_token_ids),
                                    self.max_model_len - len(s.token_ids)))
            for s, c in step_plan])
        k = max(plan.ks, default=0)  # chunks ride along with a proposer call (see _group)
        return plan, ExecuteModelRequest(
            [self._group(s, n, c) for (s, c), n in zip(step_plan, plan.ks)],
            num_lookahead_slots=k)

    def _propose(self, req: ExecuteModelRequest) -> SpeculativeProposals:
        if req.num_lookahead_slots == 0:  # plain decoding: nothing to propose
            B = len(req.seq_group_metadata_list)
            return SpeculativeProposals(torch.full((B, 0), -1, dtype=torch.long), None,
                                        torch.zeros(B, dtype=torch.long))
        return self.proposer.get_proposals(req)

    @staticmethod
    def _deadline(seqs: list[Sequence]) -> float | None:
        """The latest client deadline of the group (None when one has none)."""
        client_deadlines = [s.request.deadline for s in seqs]
        return None if None in client_deadlines else max(client_deadlines)

    def _step(self, step_plan: list[tuple[Sequence, int | None]],
              planned: Planned | None = None) -> list[StepOutput]:
        """planned: the group's proposals, requested in an earlier step (overlap)."""
        start = time.perf_counter()
        counters = self._service_counters()
        seqs = [s for s, _ in step_plan]
        chunks = [i for i, (_, chunk) in enumerate(step_plan) if chunk is not None]
        prefill = any(not s.output_token_ids for s in seqs)  # a prompt (or chunk) is computed
        plan, req = (planned.plan, planned.req) if planned else self._plan_request(step_plan)
        k = req.num_lookahead_slots
        with deadlines.bounded_by(self._deadline(seqs)):
            # Nobody speculates, so there is no proposer call to ride along: the chunks'
            # draft call runs beside the scoring (a step of its own would cost decoders a
            # proposer round trip more: 3x a decode step on small models).
            warming = (self._warm_draft(req, chunks) if planned is None and k == 0 and chunks
                       and self.k else None)
            if planned is None and k == 0:
                proposals = self._propose(req)
            else:
                with tracing.child_span("propose", {"specdecode.batch_size": len(seqs),
                                                      "specdecode.k": k}) as span:
                    proposals = planned.proposals() if planned else self._propose(req)
                    if chunks:  # a chunk's draft token only warmed the draft's KV state
                        proposals.proposal_lens[chunks] = 0
                        proposals.proposal_token_ids[chunks] = -1
                        if proposals.proposal_probs is not None:
                            proposals.proposal_probs[chunks] = 0
                    if span.is_recording():
                        span.set_attribute("specdecode.draft_tokens",
                                           int(proposals.proposal_lens.sum()))
            t_proposed = time.perf_counter()
            if self.pipeline is not None:  # the other group drafts while this one is scored
                taken = {id(s) for s in seqs}
                rest = [s for s in self.running.values() if id(s) not in taken]
                with deadlines.bounded_by(self._deadline(rest) if rest else None):
                    self.pipeline.prefetch(rest)
            with tracing.child_span("score", {"specdecode.batch_size": len(seqs),
                                                "specdecode.k": k}):
                scores = self.scorer.score_proposals(req, proposals)
            if warming is not None:
                warming.result()  # raises what the proposer raised; its proposals are discarded
        t_scored = time.perf_counter()
        with tracing.child_span("rejection_sample") as span:
            emitted, accepted = verify(self.sampler, req, proposals, scores)
            tracing.set_attributes(span, {"specdecode.accepted_tokens": sum(accepted)})
        t_verified = time.perf_counter()

        stats = StepStats(batch_size=len(seqs), k=k, ks=list(plan.ks), scoring=plan.scoring,
                          explore=plan.explore,
                          propose_s=t_proposed - start, score_s=t_scored - t_proposed,
                          verify_s=t_verified - t_scored, accepted_by_position=[0] * k)
        outputs, finished = [], []
        drafted = k > 0 and not getattr(self.proposer, "last_fallback", 0)  # proposer ran
        for i, (seq, tokens) in enumerate(zip(seqs, emitted)):
            if step_plan[i][1] is not None:  # a prompt chunk: its token is discarded
                seq.prefilled = step_plan[i][1]
                if drafted or warming is not None:
                    seq.drafted = seq.prefilled
                continue
            n = int(proposals.proposal_lens[i])
            if drafted and plan.ks[i]:  # it read the sequence and its first n-1 proposals
                seq.drafted = len(seq.token_ids) + min(len(tokens) - 1, max(n - 1, 0))
            self.policy.observe(seq.seq_id, plan.ks[i], n, len(tokens) - 1 if n else 0)
            if n:
                prefix = len(tokens) - 1  # draft tokens emitted
                seq.stats.draft_tokens += n
                seq.stats.accepted_tokens += prefix
                seq.stats.emitted_tokens += len(tokens)
                for j in range(prefix):
                    stats.accepted_by_position[j] += 1
                stats.draft_tokens += n
                stats.accepted_tokens += accepted[i]
                stats.emitted_tokens += len(tokens)
                stats.spec_sequences += 1
            seq.stats.steps += 1
            new = self._append(seq, tokens)
            stats.new_tokens += len(new)
            logprobs = None
            n_top = seq.request.sampling_params.logprobs
            if n_top is not None:
                if scores.logprobs is None:
                    raise RuntimeError("the scorer returned no logprobs for a request that "
                                       "asked for them")
                logprobs = token_logprobs(scores.logprobs[i], new, n_top)
            outputs.append(StepOutput(seq.request.request_id, new, seq.finish_reason, seq.stats,
                                      logprobs))
            if seq.finish_reason:
                finished.append(seq)
        for seq in finished:
            del self.running[seq.request.request_id]
        self._release(finished)
        stats.finished = len(finished)
        stats.total_s = time.perf_counter() - start
        stats.services = {role: step_stats(counters[role], after, stats.total_s)
                          for role, after in self._service_counters().items()}
        stats.bytes_sent = sum(s.bytes_sent for s in stats.services.values())
        stats.bytes_received = sum(s.bytes_received for s in stats.services.values())
        # A step whose proposer failed or timed out (orchestrator.cluster.fanout) says nothing of the
        # proposer's cost, nor one that computed a prompt of decode or verify costs: their
        # times are not learned.
        if (drafted or not k) and not prefill:
            self.policy.observe_step(plan, proposals.proposal_lens.tolist(), stats.propose_s,
                                     stats.score_s, stats.total_s)
        self.last_step = stats
        return outputs

    def _append(self, seq: Sequence, tokens: list[int]) -> list[int]:
        """Append what the stop rules allow; set finish_reason when the sequence ends."""
        params = seq.request.sampling_params
        room = min(params.max_tokens - len(seq.output_token_ids),
                   self.max_model_len - len(seq.token_ids))
        new = []
        for token in tokens[:room]:
            new.append(token)
            if token in params.stop_token_ids:
                seq.finish_reason = "stop"
                break
        seq.output_token_ids += new
        seq.stats.completion_tokens += len(new)
        if seq.finish_reason is None and len(new) == room:
            seq.finish_reason = "length"
        return new

    def _release(self, seqs: list[Sequence]) -> None:
        """Release on both services; one failing never keeps the other's release back."""
        if seqs:
            ids = [s.seq_id for s in seqs]
            self.policy.forget(ids)
            for service in (self.proposer, self.scorer):
                try:
                    service.release_sequences(ids)
                except Exception as exc:  # the service's cache evicts them in time
                    log.warning("releasing %d sequences on %s failed: %s", len(ids),
                                type(service).__name__, exc)

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
