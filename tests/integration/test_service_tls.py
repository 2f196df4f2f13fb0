"""The proposer's and scorer's TLS rule over real processes (issue 25): a certificate without
a client CA refuses to start with one clear line, unless `--tls-client-auth none` asks for
TLS without client certificates, which starts with a warning."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from specdecode.serving.tls import TlsFiles
from specdecode_stack.local import free_port, wait_process_serving
from tests.support.certs import TestCA


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    ca = TestCA(tmp_path_factory.mktemp("pki"))
    return ca, ca.issue("server")


def serve(role: str, *args: str, port: int = 0) -> list[str]:
    model = ["--model", "ngram"] if role == "proposer" else []
    return [sys.executable, "-m", "specdecode_stack.cli", "serve", role, *model, "--port",
            str(port or free_port()), "--log-format", "text", *args]


@pytest.mark.parametrize("role", ["proposer", "scorer"])
def test_a_certificate_without_a_client_ca_refuses_to_start(pki, role):
    _, server = pki
    out = subprocess.run(serve(role, "--tls-cert", server.cert, "--tls-key", server.key),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith("error: --tls-cert without --tls-ca: the proposer and scorer "
                                "accept only mutual-TLS peers"), out.stderr
    assert "Traceback" not in out.stderr


def test_tls_without_client_certificates_is_explicit_and_warned(pki):
    ca, server = pki
    port = free_port()
    process = subprocess.Popen(serve("proposer", "--tls-cert", server.cert, "--tls-key",
                                     server.key, "--tls-client-auth", "none", port=port),
                               stderr=subprocess.PIPE, text=True)
    try:  # a client with no certificate of its own is served
        wait_process_serving(f"127.0.0.1:{port}", 300, process, TlsFiles(ca=ca.ca_file))
    finally:
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    assert process.returncode == 0
    assert "WARNING specdecode.serving.tls serving TLS without client certificates" in err
