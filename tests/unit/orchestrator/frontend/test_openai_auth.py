"""The OpenAI HTTP API behind the gRPC API's bearer tokens (specdecode.serving.auth)."""

from __future__ import annotations


def test_http_api_takes_the_grpc_bearer_tokens(tmp_path):
    """With --auth-token-file the OpenAI API asks for the same tokens (401 in OpenAI's shape
    without one), its schema (/openapi.json) too; /health stays open, as the gRPC health
    service does."""
    from fastapi.testclient import TestClient

    from orchestrator.frontend.admission import Admission
    from orchestrator.frontend.generation import Frontend
    from orchestrator.frontend.openai_api import create_app
    from specdecode.serving.auth import TokenSet

    (tmp_path / "tokens").write_text("# clients\nsecret-1\n")
    app = create_app(Frontend(Admission(1, 0)), TokenSet(str(tmp_path / "tokens")))
    with TestClient(app) as http:
        denied = http.get("/v1/models")
        assert denied.status_code == 401
        assert denied.json()["error"]["code"] == "invalid_api_key"
        assert http.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        # Authorised, the call reaches the API (503: this frontend is still loading).
        assert http.get("/v1/models", headers={"Authorization": "Bearer secret-1"}).status_code == 503
        assert http.get("/health").status_code == 503  # open, and honest about loading
        # vLLM's extras: tokenizing is work, behind the tokens; version, ping and metrics open.
        for path in ("/tokenize", "/detokenize"):
            assert http.post(path, json={}).status_code == 401, path
        assert http.get("/version").status_code == 200 and http.get("/metrics").status_code == 200
        assert http.get("/ping").status_code == 503
        # The schema lists what a token opens: behind the tokens; the browsable docs are off.
        assert http.get("/openapi.json").status_code == 401
        schema = http.get("/openapi.json", headers={"Authorization": "Bearer secret-1"})
        assert schema.status_code == 200 and "/v1/chat/completions" in schema.json()["paths"]
        assert http.get("/docs").status_code == http.get("/redoc").status_code == 404
