"""What the HTTP API tells its operators and clients about each request, as ASGI middleware:
Prometheus counts and durations by route, method and status (4xx and 5xx included, whatever
answered them: a guard, a handler, an unknown route), and an `X-Request-Id` on every
response, the client's own or a fresh one (vLLM's header), which is also the generation's
request id (its span's `specdecode.request_id`, the `cmpl-<id>` of its response)."""

from __future__ import annotations

import time
import uuid

from prometheus_client import Counter, Histogram
from starlette.routing import Match

from orchestrator.engine.step_metrics import LATENCY_BUCKETS

HTTP_REQUESTS = Counter("specdecode_http_requests", "HTTP API requests answered, by route "
                        "template, method and status code.", ["route", "method", "status"])
HTTP_SECONDS = Histogram("specdecode_http_request_duration_seconds",
                         "HTTP API request time, to the end of the response body (a stream "
                         "lasts its whole generation).", ["route", "method", "status"],
                         buckets=LATENCY_BUCKETS)
# Labels stay bounded whatever clients send: a path no route serves, a method HTTP does not
# define.
UNMATCHED = "unmatched"
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
REQUEST_ID_HEADER = "x-request-id"


def request_id_of(scope) -> str:
    """The request's id as RequestId set it (for a handler: `request.scope`)."""
    return scope["state"]["request_id"]


class RequestId:
    """Give each request an id: its `X-Request-Id` header if it has one, else a fresh hex
    uuid; kept in the scope's state and sent back as the response's `X-Request-Id`."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(REQUEST_ID_HEADER.encode())
        request_id = given.decode("latin-1") if given else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", [])
                           if k.lower() != REQUEST_ID_HEADER.encode()]
                headers.append((REQUEST_ID_HEADER.encode(), request_id.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)
        await self.app(scope, receive, send_with_id)


class HttpMetrics:
    """Count and time every HTTP request by its route's template (`/v1/models/{model_id}`,
    not the path), method and status. Outermost, so that it sees what the guards answer
    (401, 413) and, as 500, an exception that escapes the app. Counted before the last
    body message goes out: a client that scrapes /metrics once it has its answer finds it
    counted (after the send, a busy host let the scrape go first)."""

    def __init__(self, app, routes):
        self.app, self.routes = app, routes

    def route_of(self, scope) -> str:
        for route in self.routes:
            match, _ = route.matches(scope)
            if match is not Match.NONE:  # PARTIAL: the path, another method (405)
                return getattr(route, "path_format", route.path)
        return UNMATCHED

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status, counted, start = 500, False, time.perf_counter()  # 500: no response started

        def count():
            nonlocal counted
            if not counted:
                counted = True
                method = scope["method"] if scope["method"] in METHODS else "other"
                labels = (self.route_of(scope), method, str(status))
                HTTP_REQUESTS.labels(*labels).inc()
                HTTP_SECONDS.labels(*labels).observe(time.perf_counter() - start)

        async def observe(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                count()
            await send(message)
        try:
            await self.app(scope, receive, observe)
        finally:
            count()
