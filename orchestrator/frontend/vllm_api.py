"""The endpoints a client or an operator of a vLLM server expects beside OpenAI's, with
vLLM's bodies:

    POST /tokenize     {"prompt": text} or {"messages": [...]} -> {"count", "max_model_len",
                       "tokens", "token_strs"}
    POST /detokenize   {"tokens": [ids]} -> {"prompt": text}
    GET  /version      {"version": this server's}
    GET  /metrics      Prometheus' text (or OpenMetrics, as the scraper asks): what the
                       --metrics-port serves, and the request metrics again under vLLM's
                       names (orchestrator.frontend.vllm_metrics)

Errors are OpenAI-shaped (400 naming the field, 404 for another model, 503 while loading).
"""

from __future__ import annotations

import asyncio
import importlib.metadata

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from pydantic import BaseModel, ConfigDict
from starlette.requests import Request

from orchestrator.frontend.chat_template import render_chat
from orchestrator.frontend.generation import Frontend
from orchestrator.frontend.openai_protocol import APIError, ChatMessage
from orchestrator.frontend.request import GenerationRequest
from orchestrator.frontend.vllm_metrics import VllmNames
from specdecode.telemetry.served_metrics import SERVED


class TokenizeRequest(BaseModel):
    """vLLM's two tokenize bodies in one: a prompt, or chat messages."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True  # messages only
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


def add_vllm_routes(app: FastAPI, frontend: Frontend, check_model) -> None:
    """The routes above on `app`; `check_model(name)` answers 503 while loading and 404
    for a model not served here."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SERVED)
    registry.register(VllmNames(SERVED))
    version = importlib.metadata.version("specdecode")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        served = check_model(body.model)
        ids = await asyncio.to_thread(_tokenize, frontend, body)
        strs = [frontend.tokenizer.convert_ids_to_tokens(i) for i in ids] \
            if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": served.max_model_len, "tokens": ids,
                "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        served = check_model(body.model)
        _require_tokenizer(frontend)
        bad = [t for t in body.tokens if not 0 <= t < served.vocab_size]
        if bad:
            raise APIError(400, f"tokens: ids {bad[:5]} outside the vocabulary "
                                f"[0, {served.vocab_size})", param="tokens")
        if len(body.tokens) > served.max_model_len:
            raise APIError(400, f"tokens: {len(body.tokens)} ids; at most the max model "
                                f"length, {served.max_model_len}", param="tokens")
        text = await asyncio.to_thread(frontend.tokenizer.decode, body.tokens)
        return {"prompt": text}

    @app.get("/version")
    async def get_version():
        return {"version": version}

    @app.get("/metrics")
    async def metrics(request: Request):
        encode, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encode(registry), media_type=content_type)


def _require_tokenizer(frontend: Frontend) -> None:
    if frontend.tokenizer is None:
        raise APIError(400, "tokens: this server has no tokenizer (--tokenizer none)",
                       param="tokens")


def _tokenize(frontend: Frontend, body: TokenizeRequest) -> list[int]:
    """The token ids of the body's prompt or conversation, its size bounded first."""
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "prompt: give either prompt or messages", param="prompt")
    _require_tokenizer(frontend)
    if body.messages is not None:
        text = render_chat(frontend.tokenizer, frontend.limits, body.messages,
                           body.add_generation_prompt)
        special = bool(body.add_special_tokens)
    else:
        frontend.limits.check(GenerationRequest(body.prompt))
        text, special = body.prompt, body.add_special_tokens is not False
    return frontend.tokenize(text, special)
