"""The proposer's and scorer's TLS rule (specdecode.serving.tls.check_client_auth)."""

from __future__ import annotations

import logging

import pytest

from specdecode.serving.tls import TlsFiles, check_client_auth
from tests.support.certs import TestCA


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    ca = TestCA(tmp_path_factory.mktemp("pki"))
    return ca, ca.issue("service", ("localhost",))


def test_tls_without_a_client_ca_is_refused(pki):
    _, server = pki
    with pytest.raises(ValueError, match="^--tls-cert without --tls-ca: .* --tls-client-auth none"):
        check_client_auth(TlsFiles(server.cert, server.key))


def test_no_client_auth_must_be_explicit_and_is_a_warning(pki, caplog):
    ca, server = pki
    with caplog.at_level(logging.WARNING, logger="specdecode.serving.tls"):
        check_client_auth(TlsFiles(server.cert, server.key), "none")
    assert "without client certificates" in caplog.text
    with pytest.raises(ValueError, match="contradicts --tls-ca"):
        check_client_auth(TlsFiles(server.cert, server.key, ca.ca_file), "none")


def test_mutual_tls_and_plaintext_pass(pki):
    ca, server = pki
    check_client_auth(TlsFiles(server.cert, server.key, ca.ca_file))
    check_client_auth(TlsFiles())


def test_up_needs_a_client_ca_with_its_certificate(pki):
    """`specdecode up` gives the proposer and scorer its certificate: without a CA they
    would refuse to start, so `up` refuses first, before starting anything."""
    from click.testing import CliRunner

    from specdecode_stack.cli import main
    _, server = pki
    result = CliRunner().invoke(main, ["up", "--tls-cert", server.cert, "--tls-key", server.key])
    assert result.exit_code == 2
    assert "--tls-cert, --tls-key and --tls-ca go together" in result.output
