"""The replicas of one service (the scorer's or the proposer's), as the orchestrator sees them.

`--scorer` / `--proposer` name one or more HOST:PORT; each name may resolve to several
addresses (a headless Service). Every address is a replica with its own channel. A replica
is *up* (on the routing ring) or *down*:

- a failed call takes it down at once and keeps it out for a back-off (0.5 s, doubling with
  failures in a row, at most 10 s) -- except a call that merely timed out on the last
  replica up: that one stays (it is slow, not gone) and the step retries it;
- a background thread checks every replica's grpc.health.v1 every `health_interval_s` and
  brings a down one back when it reports SERVING (after its back-off, and after checking
  that it serves the same model as the others); it also re-resolves the names every
  `resolve_interval_s`, adding replicas that appeared and dropping those that left.

Listeners hear the number of replicas up after every change (the orchestrator reports
NOT_SERVING while its scorer has none). Releases of finished sequences go, off the step's
thread, to every replica that saw the sequence.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2
from prometheus_client import Counter, Gauge

from orchestrator.cluster.remote import open_channel
from orchestrator.config import ServiceSecurity
from orchestrator.cluster.routing import HashRing, resolve
from specdecode.serving.health import UNREACHABLE, ServiceUnreachableError, health_status
from specdecode.model_info import ModelInfo

log = logging.getLogger(__name__)

REPLICA_UP = Gauge("specdecode_replica_up", "1 while a replica is on the routing ring.",
                   ["role", "replica"])
REPLICA_SEQUENCES = Gauge("specdecode_replica_sequences",
                          "Running sequences routed to a replica in the last step.",
                          ["role", "replica"])
REPLICA_STEPS = Counter("specdecode_replica_steps", "Step calls (sub-batches) sent to a replica.",
                        ["role", "replica"])
REPLICA_FAILURES = Counter("specdecode_replica_failures",
                           "Step calls to a replica that failed or timed out.",
                           ["role", "replica"])

BACKOFF_S, MAX_BACKOFF_S = 0.5, 10.0
# What each replica's client counts (orchestrator.cluster.remote), summed over the set.
COUNTERS = ("bytes_sent", "bytes_received", "service_seconds", "full_resends")
HEALTH_TIMEOUT_S = 2.0


@dataclass
class Replica:
    address: str  # ip:port, the ring key
    name: str  # HOST:PORT as configured (the authority; TLS verifies against it)
    client: object  # a RemoteScorer or RemoteProposer
    up: bool = False
    failures: int = 0  # failed calls in a row
    retry_at: float = 0.0  # time.monotonic() before which it stays down
    verified: bool = False  # its model info matched the service's


class ReplicaSet:
    def __init__(self, role: str, spec: str, make_client: Callable[[grpc.Channel, str], object],
                 channel_options: list[tuple[str, int]], *, health_interval_s: float = 1.0,
                 resolve_interval_s: float = 10.0, security: ServiceSecurity = ServiceSecurity()):
        self.role, self.spec = role, spec
        self.make_client, self.channel_options = make_client, channel_options
        self.security = security  # TLS / token for every replica's channel
        self.health_interval_s, self.resolve_interval_s = health_interval_s, resolve_interval_s
        self.info: ModelInfo | None = None  # the model every replica must serve
        self.listeners: list[Callable[[int], None]] = []
        self.pool = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix=f"{role}-calls")
        self._lock = threading.Lock()
        self._replicas: dict[str, Replica] = {}
        self._ring = HashRing([])
        self._owner: dict[int, str] = {}  # running sequence -> its replica in the last step
        self._touched: dict[int, set[str]] = {}  # running sequence -> replicas that saw it
        self._none_up_since: float | None = time.monotonic()
        self._gone: dict[str, float] = {}  # client counters of replicas no longer resolved
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"{role}-health", daemon=True)

    # -- membership ----------------------------------------------------------------------

    def _resolve(self) -> None:
        addresses, failed = resolve(self.spec)
        for name in failed:
            log.warning("%s address %s does not resolve", self.role, name)
        if not addresses and failed:
            return  # a resolver hiccup does not empty the set
        with self._lock:
            for address, name in addresses:
                if address not in self._replicas:
                    channel = open_channel(address, self.channel_options, name, self.security)
                    self._replicas[address] = Replica(address, name,
                                                      self.make_client(channel, address))
                    log.info("%s replica %s (%s) added", self.role, address, name)
            gone = set(self._replicas) - {a for a, _ in addresses}
        for address in gone:
            self._set_up(address, False, "no longer resolved")
            with self._lock:
                replica = self._replicas.pop(address)
            replica.client.channel.close()
            for counter in COUNTERS:
                self._gone[counter] = self._gone.get(counter, 0) + getattr(replica.client, counter)
            for metric in (REPLICA_UP, REPLICA_SEQUENCES):
                metric.remove(self.role, address)

    def _set_up(self, address: str, up: bool, why: str) -> None:
        with self._lock:
            replica = self._replicas.get(address)
            if replica is None or replica.up == up:
                return
            replica.up = up
            live = [r.address for r in self._replicas.values() if r.up]
            self._ring = HashRing(live)
            self._none_up_since = None if live else time.monotonic()
        REPLICA_UP.labels(self.role, address).set(int(up))
        (log.info if up else log.warning)("%s replica %s %s (%s); %d up", self.role, address,
                                          "up" if up else "down", why, len(live))
        for listener in self.listeners:
            listener(len(live))

    def _check(self, replica: Replica) -> None:
        status = health_status(replica.client.channel, HEALTH_TIMEOUT_S)
        if status == health_pb2.HealthCheckResponse.SERVING:
            if not replica.up and time.monotonic() >= replica.retry_at and self._verify(replica):
                self._set_up(replica.address, True, "reports SERVING")
        elif replica.up and status is not None:
            # NOT_SERVING (draining) or unreachable; a check that merely timed out on a busy
            # replica leaves it up (its calls have their own deadlines).
            self._set_up(replica.address, False, "health check")

    def _verify(self, replica: Replica) -> bool:
        if replica.verified:
            return True
        try:
            info = replica.client.model_info()
        except grpc.RpcError:
            return False
        if self.info is None:
            self.info = info
        mismatch = [f for f in ("model_name", "vocab_size", "tokenizer_fingerprint")
                    if getattr(info, f) != getattr(self.info, f)]
        if mismatch:
            log.error("%s replica %s serves another model (%s differ): kept out", self.role,
                      replica.address, ", ".join(mismatch))
            return False
        replica.verified = True
        return True

    def check_all(self) -> None:
        with self._lock:
            replicas = list(self._replicas.values())
        for future in [self.pool.submit(self._check, r) for r in replicas]:
            future.result()

    def _watch(self) -> None:
        next_resolve = time.monotonic() + self.resolve_interval_s
        while not self._stop.wait(self.health_interval_s):
            try:
                if time.monotonic() >= next_resolve:
                    next_resolve = time.monotonic() + self.resolve_interval_s
                    self._resolve()
                self.check_all()
            except Exception:  # keep watching
                log.exception("%s health check failed", self.role)

    def start(self, timeout_s: float) -> ModelInfo:
        """Resolve, wait until a replica reports SERVING (ServiceUnreachableError naming the
        role and address after timeout_s), then watch in the background. Returns the
        service's ModelInfo."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._resolve()
            self.check_all()
            if self.up_count():
                break
            if time.monotonic() >= deadline:
                reachable = any(health_status(r.client.channel, 1) not in (None, UNREACHABLE)
                                for r in list(self._replicas.values()))
                self.close()
                raise ServiceUnreachableError(
                    f"the {self.role} at {self.spec} did not report SERVING within "
                    f"{timeout_s:.0f}s (still loading its model?)" if reachable else
                    f"cannot reach the {self.role} at {self.spec} within {timeout_s:.0f}s "
                    f"(is `specdecode serve {self.role}` running there?)")
            time.sleep(0.2)
        self._thread.start()
        return self.info

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.pool.shutdown(wait=True)  # pending releases finish
        for replica in self._replicas.values():
            replica.client.channel.close()

    # -- routing -------------------------------------------------------------------------

    def up_count(self) -> int:
        with self._lock:
            return sum(r.up for r in self._replicas.values())

    def down_for(self) -> float:
        """Seconds since the last replica went down (0 while one is up)."""
        since = self._none_up_since
        return 0.0 if since is None else time.monotonic() - since

    def describe(self) -> str:
        return f"{self.role} ({self.spec})"

    def first_up(self) -> tuple[str, object] | None:
        """(address, client) of the first replica up in address order, or None."""
        with self._lock:
            up = sorted((r.address, r.client) for r in self._replicas.values() if r.up)
        return up[0] if up else None

    def route(self, seq_ids: list[int]) -> dict[str, tuple[list[int], object, list[int]]]:
        """Replica address -> (positions in seq_ids it serves, its client, the positions it
        has not served before: it will compute them from scratch); {} when none is up."""
        with self._lock:
            ring = self._ring
            plan: dict[str, tuple[list[int], object, list[int]]] = {}
            for i, seq_id in enumerate(seq_ids):
                owner = ring.owner(seq_id)
                if owner is None:
                    return {}
                positions, _, fresh = plan.setdefault(
                    owner, ([], self._replicas[owner].client, []))
                positions.append(i)
                touched = self._touched.setdefault(seq_id, set())
                if owner not in touched:
                    fresh.append(i)
                    touched.add(owner)
                self._owner[seq_id] = owner
            counts = {a: 0 for a in self._replicas}
            for owner in self._owner.values():
                counts[owner] = counts.get(owner, 0) + 1
        for address, n in counts.items():
            REPLICA_SEQUENCES.labels(self.role, address).set(n)
        return plan

    def succeeded(self, address: str) -> None:
        REPLICA_STEPS.labels(self.role, address).inc()
        with self._lock:
            replica = self._replicas.get(address)
            if replica is not None:
                replica.failures = 0

    def failed(self, address: str, exc: BaseException, *, slow: bool = False) -> bool:
        """Count a failed step call and take the replica off the ring (its sequences move
        to the others) with a back-off; True if it went off. A call that was merely `slow`
        (timed out, overloaded) does not take off the last replica up: it still answers,
        and with none up every step would fail; the caller retries it with a longer
        deadline instead."""
        REPLICA_STEPS.labels(self.role, address).inc()
        REPLICA_FAILURES.labels(self.role, address).inc()
        with self._lock:
            replica = self._replicas.get(address)
            if replica is None:
                return False
            replica.failures += 1
            replica.retry_at = time.monotonic() + min(
                MAX_BACKOFF_S, BACKOFF_S * 2 ** (replica.failures - 1))
            keep = slow and replica.up and not any(
                r.up for r in self._replicas.values() if r is not replica)
        code = exc.code().name if isinstance(exc, grpc.Call) else type(exc).__name__
        if keep:
            log.warning("%s replica %s: call failed (%s); kept up, the last one", self.role,
                        address, code)
            return False
        self._set_up(address, False, f"call failed: {code}")
        return True

    def release(self, seq_ids: list[int]) -> None:
        """Forget the sequences; every replica that saw one releases it (in the background:
        a slow replica never holds up a step)."""
        by_replica: dict[str, list[int]] = {}
        with self._lock:
            for seq_id in seq_ids:
                self._owner.pop(seq_id, None)
                for address in self._touched.pop(seq_id, ()):
                    by_replica.setdefault(address, []).append(seq_id)
            clients = {a: self._replicas[a].client for a in by_replica if a in self._replicas}
        for address, client in clients.items():
            self.pool.submit(self._release_on, address, client, by_replica[address])

    def _release_on(self, address: str, client, seq_ids: list[int]) -> None:
        try:
            client.release_sequences(seq_ids)
        except grpc.RpcError as exc:  # a replica that lost its cache has nothing to free
            with self._lock:
                replica = self._replicas.get(address)
                up = replica is not None and replica.up
            # Expected while it is down (one line per finished step otherwise).
            (log.warning if up else log.debug)(
                "%s replica %s: releasing %d sequences failed: %s", self.role, address,
                len(seq_ids), exc.code().name)

    def total(self, counter: str):
        """A client counter (one of COUNTERS) summed over every replica there has been."""
        with self._lock:
            return self._gone.get(counter, 0) + sum(getattr(r.client, counter)
                                                    for r in self._replicas.values())

    @property
    def bytes_sent(self) -> int:
        return self.total("bytes_sent")

    @property
    def bytes_received(self) -> int:
        return self.total("bytes_received")
