"""Which replica serves a sequence, and which replicas an address names.

A sequence goes to the replica that owns its id on a consistent-hash ring of the replicas
that are up, so its KV cache stays on one replica from step to step. When a replica leaves
the ring only its own sequences move (to the next owner on the ring), and when it comes back
it takes the same share again. The output never depends on the replica: every request
carries full token ids and a replica recomputes what it does not hold (docs/design.md, invariant 3).
"""

from __future__ import annotations

import bisect
import hashlib
import socket


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing with `vnodes` points per replica (evens out the shares)."""

    def __init__(self, replicas: list[str], vnodes: int = 64):
        points = sorted((_point(f"{r}#{i}".encode()), r) for r in replicas for i in range(vnodes))
        self._points = [p for p, _ in points]
        self._owners = [r for _, r in points]
        self.replicas = sorted(set(replicas))

    def owner(self, seq_id: int) -> str | None:
        """The replica that serves `seq_id`, or None when the ring is empty."""
        if not self._points:
            return None
        i = bisect.bisect(self._points, _point(seq_id.to_bytes(8, "little", signed=True)))
        return self._owners[i % len(self._points)]


def split_address(address: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); ValueError naming the address."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{address!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def resolve(spec: str) -> tuple[list[tuple[str, str]], list[str]]:
    """A --scorer/--proposer value ('HOST:PORT[,HOST:PORT...]') -> ([(ip:port, name:port)]
    for every address each name resolves to, sorted), [names that did not resolve]. A
    headless Service's name resolves to one address per ready pod. IPv4 answers are
    preferred when a name has both (so 'localhost' is one replica, not two)."""
    found: dict[str, str] = {}
    failed = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        host, port = split_address(part)
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror:
            failed.append(part)
            continue
        chosen = [i for i in infos if i[0] == socket.AF_INET] or infos
        for family, *_, sockaddr in chosen:
            ip = sockaddr[0]
            found.setdefault(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}",
                             part)
    return sorted(found.items()), failed
