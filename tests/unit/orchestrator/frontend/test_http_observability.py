"""The HTTP metrics middleware on a bare ASGI app (no server): what it counts and when."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY
from starlette.routing import Route

from orchestrator.frontend.http_observability import HttpMetrics

ROUTES = [Route("/v1/models/{model_id}", lambda request: None, methods=["GET"])]


def count(route: str, status: str) -> float:
    labels = {"route": route, "method": "GET", "status": status}
    return REGISTRY.get_sample_value("specdecode_http_requests_total", labels) or 0.0


def call(app, path: str) -> list[tuple[dict, float]]:
    """Each message the middleware sends, with the 404 count at the moment it was sent."""
    sent = []

    async def send(message):
        sent.append((message, count("/v1/models/{model_id}", "404")))

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}
    scope = {"type": "http", "method": "GET", "path": path, "root_path": "",
             "query_string": b"", "headers": []}
    asyncio.run(HttpMetrics(app, ROUTES)(scope, receive, send))
    return sent


async def not_found(scope, receive, send):
    await send({"type": "http.response.start", "status": 404, "headers": []})
    await send({"type": "http.response.body", "body": b"no", "more_body": True})
    await send({"type": "http.response.body", "body": b"pe"})


def test_a_request_is_counted_once_before_its_last_body_message_goes_out():
    """A client that scrapes /metrics as soon as it has its answer finds it counted (counted
    after the send, a busy host let the scrape go first: the dashboard test's flake)."""
    before = count("/v1/models/{model_id}", "404")
    sent = call(not_found, "/v1/models/x")
    assert [n - before for _, n in sent] == [0, 0, 1]
    assert count("/v1/models/{model_id}", "404") == before + 1


def test_an_app_that_fails_before_answering_counts_as_500():
    async def fails(scope, receive, send):
        raise RuntimeError("boom")
    before = count("unmatched", "500")
    with pytest.raises(RuntimeError, match="boom"):  # counted, and the error goes on
        call(fails, "/nowhere")
    assert count("unmatched", "500") == before + 1
