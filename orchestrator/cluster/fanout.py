"""The proposer and scorer as the engine sees them when they run as replicated services: each
step's batch split into one sub-batch per replica (orchestrator.cluster.replicas routes by sequence
id), the sub-batches sent in parallel, the results put back in batch order.

- The scorer is required: a sub-batch whose call fails or times out is retried, with
  back-off, on the replicas up by then (its sequences recompute there from their full
  tokens), until the retry budget is spent; then the step fails with UNAVAILABLE naming the
  scorer. A timeout never takes the last replica up off the ring (it is slow, not gone):
  the step retries it with the rest of the budget at once (at least one undoubled
  deadline), since a stopped forward loses its work: with doubled deadlines, a host slower
  than the estimate (two busy loops beside the suite) spent the 30 s budget on attempts
  that each were stopped short. Retries on other replicas double the deadline each
  attempt, within the budget. When no replica has been up for a whole budget, steps fail
  at once.
- The proposer is optional: a sub-batch whose call fails or times out gets no proposals
  (proposal length 0: the scorer alone decodes it, same output), and its replica stays out
  until the background check finds it healthy again. Fallback sequences and steps are
  counted, and the step's `propose` span says so.
"""

from __future__ import annotations

import contextvars
import time

import grpc
import torch
from opentelemetry import trace
from prometheus_client import Counter

from orchestrator.engine import deadlines
from orchestrator.config import ResilienceOptions, ServiceSecurity
from orchestrator.engine.deadlines import CallCancelled, CallTimeout, step_tokens
from orchestrator.cluster.remote import RemoteProposer, RemoteScorer, keepalive_options
from orchestrator.cluster.replicas import ReplicaSet
from specdecode.errors import DeadlinePassedError, ServiceUnavailableError
from specdecode.interfaces import (SpeculativeProposals, SpeculativeProposer, SpeculativeScorer,
                                   SpeculativeScores)
from specdecode.model_info import ModelInfo
from specdecode.sequence import ExecuteModelRequest

HOUSEKEEPING_TIMEOUT_S = 5.0  # model info and releases

FALLBACK_STEPS = Counter("specdecode_proposer_fallback_steps",
                         "Steps in which some sequences went without proposals because their "
                         "proposer replica failed, was slow or was out.")
FALLBACK_SEQUENCES = Counter("specdecode_proposer_fallback_sequences",
                             "Sequence-steps without proposals because of the proposer.")

# Step-call failures worth another replica: the replica is gone, draining, overloaded or slow.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       grpc.StatusCode.ABORTED})
# ... of which these say the replica is alive but slow or busy.
SLOW = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED})


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, grpc.Call) and exc.code() in RETRYABLE


def _slow(exc: BaseException) -> bool:
    return isinstance(exc, grpc.Call) and exc.code() in SLOW


def _sub_request(req: ExecuteModelRequest, rows: list[int]) -> ExecuteModelRequest:
    if rows == list(range(len(req.seq_group_metadata_list))):
        return req  # the whole batch: keeps the request encoded once for both services
    return req.clone([req.seq_group_metadata_list[i] for i in rows])


def _put_rows(out: torch.Tensor | None, rows: list[int], part: torch.Tensor | None,
              shape: tuple[int, ...], fill: float) -> torch.Tensor | None:
    """Write part's rows into out[rows], allocating out [*shape, V] on the first part."""
    if part is None:
        return out
    if out is None:
        out = torch.full((*shape, part.shape[-1]), fill, dtype=part.dtype)
    out[rows] = part
    return out


class _Routed:
    def __init__(self, replicas: ReplicaSet, timeout: CallTimeout):
        self.replicas, self.timeout = replicas, timeout

    # Which failures take a replica out (and, for the scorer, are retried elsewhere).
    replica_failure = staticmethod(_retryable)
    # Which of those leave the last replica up on the ring.
    keeps_last = staticmethod(lambda exc: False)

    def _fan_out(self, req: ExecuteModelRequest, rows: list[int], call, attempt: int = 0,
                 budget_s: float | None = None, stretch: bool = False) -> tuple[
            dict[str, tuple[list[int], object]], dict[str, tuple[list[int], BaseException]]]:
        """Route `rows` of the batch and run call(client, sub_request, rows, timeout) per
        replica in parallel: ({replica: (rows, result)}, {replica: (rows, error)}).
        DeadlinePassedError once the step's client deadline has passed. A sequence new to
        its replica counts its whole length (recomputed there); retry `attempt` n doubles
        the timeout n times (a replica that took over others' sequences is busier), but
        not past `budget_s` seconds unless the undoubled timeout is longer; `stretch`: the
        whole of `budget_s` (or the undoubled timeout, if longer)."""
        groups = req.seq_group_metadata_list
        futures = {}
        for address, (positions, client, fresh) in self.replicas.route(
                [groups[i].seq_id for i in rows]).items():
            sub_rows = [rows[p] for p in positions]
            sub = _sub_request(req, sub_rows)
            tokens = step_tokens(sub) + sum(groups[rows[p]].data.get_len() for p in fresh
                                            if not groups[rows[p]].is_prompt)
            # On this thread: the client deadline lives here.
            timeout = self.timeout.timeout(tokens, 2 ** attempt)
            if budget_s is not None:
                whole = max(budget_s, self.timeout.timeout(tokens))
                timeout = whole if stretch else min(timeout, whole)
                left = deadlines.remaining()
                timeout = timeout if left is None else min(timeout, left)
            if timeout <= 0:
                raise DeadlinePassedError("the deadline of every request in the step passed")
            # In a copy of this thread's context: the call's client span is a child of the
            # step's span, and the trace context travels to the service.
            futures[address] = (sub_rows, self.replicas.pool.submit(
                contextvars.copy_context().run, self._timed, call, client, sub, sub_rows,
                timeout, tokens))
        done, failed = {}, {}
        for address, (sub_rows, future) in futures.items():
            try:
                done[address] = (sub_rows, future.result())
                self.replicas.succeeded(address)
            except CallCancelled:
                raise  # the engine stopped it: the replica did nothing wrong
            except Exception as exc:
                left = deadlines.remaining()
                if left is not None and left <= 0:  # the clients' deadline, not the replica's
                    raise DeadlinePassedError(
                        "the deadline of every request in the step passed") from exc
                if not self.replica_failure(exc):
                    raise
                self.replicas.failed(address, exc, slow=self.keeps_last(exc))
                failed[address] = (sub_rows, exc)
        return done, failed

    def _timed(self, call, client, sub: ExecuteModelRequest, rows: list[int], timeout: float,
               tokens: int):
        start = time.monotonic()
        result = call(client, sub, rows, timeout)
        self.timeout.observe(time.monotonic() - start, tokens)
        return result

    def close(self) -> None:
        self.replicas.close()

    def release_sequences(self, seq_ids: list[int]) -> int:
        self.replicas.release(seq_ids)
        return 0  # released in the background; the count is not waited for

    @property
    def bytes_sent(self) -> int:
        return self.replicas.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.replicas.bytes_received

    @property
    def service_seconds(self) -> float:
        return self.replicas.total("service_seconds")

    @property
    def full_resends(self) -> int:
        return self.replicas.total("full_resends")


class RoutedScorer(_Routed, SpeculativeScorer):
    keeps_last = staticmethod(_slow)

    def __init__(self, replicas: ReplicaSet, timeout: CallTimeout, retry_timeout_s: float):
        super().__init__(replicas, timeout)
        self.retry_timeout_s = retry_timeout_s

    def _unavailable(self, why: str) -> ServiceUnavailableError:
        return ServiceUnavailableError(f"the {self.replicas.describe()} is unavailable: {why}")

    def score_proposals(self, execute_model_req: ExecuteModelRequest,
                        proposals: SpeculativeProposals) -> SpeculativeScores:
        req = execute_model_req
        B, K = len(req.seq_group_metadata_list), req.num_lookahead_slots + 1
        give_up = time.monotonic() + self.retry_timeout_s
        token_ids = torch.full((B, K), -1, dtype=torch.long)
        probs = logprobs = None
        pending, attempt, last_error = list(range(B)), 0, "no replica is up"
        stretch = False  # the last replica up was slow: it gets the rest of the budget

        def call(client, sub, rows, timeout):
            index = torch.tensor(rows)
            sub_proposals = SpeculativeProposals(
                proposals.proposal_token_ids[index],
                None if proposals.proposal_probs is None else proposals.proposal_probs[index],
                proposals.proposal_lens[index])
            return client.score_proposals(sub, sub_proposals, timeout=timeout)

        while pending:
            if self.replicas.up_count() == 0 and self.replicas.down_for() >= self.retry_timeout_s:
                raise self._unavailable(f"no replica up for {self.replicas.down_for():.0f}s")
            done, failed = self._fan_out(req, pending, call, attempt,
                                         give_up - time.monotonic(), stretch) \
                if self.replicas.up_count() else ({}, {})
            for rows, scores in done.values():
                token_ids[rows] = scores.token_ids
                probs = _put_rows(probs, rows, scores.probs, (B, K), 0.0)
                logprobs = _put_rows(logprobs, rows, scores.logprobs, (B, K), float("-inf"))
            pending = sorted(i for rows, _ in failed.values() for i in rows) if done or failed \
                else pending
            if failed:
                last_error = "; ".join(f"{a}: {e.code().name} {e.details()}"
                                       for a, (_, e) in failed.items())
                stretch = self.replicas.up_count() == 1 and all(
                    _slow(e) for _, e in failed.values())
            if not pending:
                break
            left = deadlines.remaining()
            if left is not None and left <= 0:
                raise DeadlinePassedError("the deadline of every request in the step passed")
            if time.monotonic() >= give_up:
                raise self._unavailable(f"retried for {self.retry_timeout_s:.0f}s "
                                        f"({last_error})")
            # Retry at once if another replica is up, else back off for the health check.
            time.sleep(0 if attempt == 0 and self.replicas.up_count() else
                       min(1.0, 0.05 * 2 ** attempt))
            attempt += 1
        return SpeculativeScores(probs=probs, logprobs=logprobs, token_ids=token_ids)


class RoutedProposer(_Routed, SpeculativeProposer):
    # Any failure of the optional proposer means no proposals from that replica this step.
    replica_failure = staticmethod(lambda exc: True)

    def get_proposals(self, execute_model_req: ExecuteModelRequest) -> SpeculativeProposals:
        req = execute_model_req
        B, k = len(req.seq_group_metadata_list), req.num_lookahead_slots
        ids = torch.full((B, k), -1, dtype=torch.long)
        lens = torch.zeros(B, dtype=torch.long)
        probs = None

        def call(client, sub, rows, timeout):
            return client.get_proposals(sub, timeout=timeout)

        lost = B
        if self.replicas.up_count():
            done, _ = self._fan_out(req, list(range(B)), call)
            for rows, proposals in done.values():
                ids[rows], lens[rows] = proposals.proposal_token_ids, proposals.proposal_lens
                probs = _put_rows(probs, rows, proposals.proposal_probs, (B, k), 0.0)
            lost = B - sum(len(rows) for rows, _ in done.values())
        if lost:
            FALLBACK_STEPS.inc()
            FALLBACK_SEQUENCES.inc(lost)
        span = trace.get_current_span()  # the step's `propose` span
        if span.is_recording():
            span.set_attributes({"specdecode.proposer.fallback": bool(lost),
                                 "specdecode.proposer.fallback_sequences": lost})
        return SpeculativeProposals(proposal_token_ids=ids, proposal_probs=probs,
                                    proposal_lens=lens, fallback=lost)


def connect_services(proposer: str, scorer: str, channel_options: list[tuple[str, int]],
                     options: ResilienceOptions, connect_timeout_s: float,
                     security: ServiceSecurity = ServiceSecurity(), deltas: bool = True,
                     ) -> tuple[RoutedProposer, RoutedScorer, ModelInfo, ModelInfo]:
    """Both services' replica sets, started (ServiceUnreachableError if either has no
    replica SERVING within connect_timeout_s), with their model infos; `security`: TLS and
    token of their channels; `deltas`: step calls carry sequence deltas
    (specdecode.wire.delta_encoder), tracked per replica."""
    channel_options = [*channel_options, *keepalive_options(options.keepalive_interval_s,
                                                            options.keepalive_timeout_s)]

    def replica_set(role: str, spec: str, client) -> ReplicaSet:
        return ReplicaSet(role, spec, lambda channel, address: client(
            channel, HOUSEKEEPING_TIMEOUT_S, address, deltas), channel_options,
            health_interval_s=options.health_interval_s,
            resolve_interval_s=options.resolve_interval_s, security=security)
    proposers = replica_set("proposer", proposer, RemoteProposer)
    scorers = replica_set("scorer", scorer, RemoteScorer)
    try:
        p_info = proposers.start(connect_timeout_s)
        s_info = scorers.start(connect_timeout_s)
    except BaseException:
        proposers.close()
        scorers.close()
        raise
    # The proposer's floor is lower: past it, a step goes on without speculation.
    return (RoutedProposer(proposers, CallTimeout(options.proposer_timeout_s, floor_s=1.0)),
            RoutedScorer(scorers, CallTimeout(options.scorer_timeout_s),
                         options.scorer_retry_s), p_info, s_info)
