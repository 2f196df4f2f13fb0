"""Transport security for every specdecode server and client (docs/security.md).

A server with a certificate and key serves TLS; with a CA as well it requires client
certificates signed by that CA (mutual TLS: the proposer and scorer accept only the
orchestrator, which presents its own certificate). Certificates are read again when their
files change, so a rotated certificate (cert-manager renews into the same Secret) takes
effect on the next connection, without a restart.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TlsFiles:
    """PEM files. cert/key: this side's identity; ca: on a server, the CA that must sign
    client certificates (None = no client certificates asked for); on a client, the CA that
    signs the server's certificate (None = the system's roots)."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    def __post_init__(self):
        if bool(self.cert) != bool(self.key):
            raise ValueError("--tls-cert and --tls-key: give both or neither")
        for name in ("cert", "key", "ca"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise FileNotFoundError(f"--tls-{name}: no such file: {path}")

    @property
    def enabled(self) -> bool:
        return bool(self.cert)


CLIENT_AUTH_CHOICES = ("require", "none")


def check_client_auth(files: TlsFiles, client_auth: str = "require") -> None:
    """The proposer's and scorer's rule (docs/security.md): over TLS they accept only peers
    with a client certificate, so a certificate without a client CA is refused (ValueError,
    one line) unless client_auth is "none", which serves TLS to any client, with a warning."""
    if client_auth not in CLIENT_AUTH_CHOICES:
        raise ValueError(f"--tls-client-auth: one of {', '.join(CLIENT_AUTH_CHOICES)}, "
                         f"got {client_auth!r}")
    if not files.enabled:
        return
    if client_auth == "require" and not files.ca:
        raise ValueError("--tls-cert without --tls-ca: the proposer and scorer accept only "
                         "mutual-TLS peers; give --tls-ca (the CA of the orchestrator's client "
                         "certificate), or --tls-client-auth none to serve TLS to any client")
    if client_auth == "none":
        if files.ca:
            raise ValueError("--tls-client-auth none contradicts --tls-ca (which requires "
                             "client certificates signed by it)")
        log.warning("serving TLS without client certificates (--tls-client-auth none): any "
                    "client that reaches this port may call it unless --auth-token-file is set")


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def _mtimes(files: TlsFiles) -> tuple[float, ...]:
    return tuple(os.stat(p).st_mtime_ns for p in (files.cert, files.key, files.ca) if p)


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """TLS server credentials that re-read the files when they change (checked at each new
    connection); a CA makes client certificates required."""

    def configuration():
        return grpc.ssl_server_certificate_configuration(
            [(_read(files.key), _read(files.cert))], root_certificates=_read(files.ca))

    state = {"mtimes": _mtimes(files)}

    def fetch():
        try:
            mtimes = _mtimes(files)
            if mtimes == state["mtimes"]:
                return None  # unchanged: keep the current configuration
            config = configuration()
        except (OSError, ValueError) as exc:  # half-written during a rotation: retry later
            log.warning("TLS files changed but cannot be read yet: %s", exc)
            return None
        state["mtimes"] = mtimes
        log.info("TLS certificate reloaded from %s", files.cert)
        return config

    return grpc.dynamic_ssl_server_credentials(
        configuration(), fetch, require_client_authentication=bool(files.ca))


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """Client credentials: trust `ca` (or the system roots) and present cert/key if given."""
    return grpc.ssl_channel_credentials(root_certificates=_read(files.ca),
                                        private_key=_read(files.key),
                                        certificate_chain=_read(files.cert))


def open_channel(address: str, tls: TlsFiles | None = None,
                 options: list[tuple[str, object]] | None = None) -> grpc.Channel:
    """A blocking channel, over TLS when `tls` has a CA or a certificate, else plaintext."""
    if tls is not None and (tls.ca or tls.cert):
        return grpc.secure_channel(address, channel_credentials(tls), options=options)
    return grpc.insecure_channel(address, options=options)
