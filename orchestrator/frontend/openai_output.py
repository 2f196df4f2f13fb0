"""The OpenAI API's responses: token text and log-probabilities in OpenAI's (and vLLM's)
forms, and server-sent events."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from orchestrator.engine.request import TokenLogprobs
from orchestrator.frontend.admission import Slot
from orchestrator.frontend.generation import Delta
from orchestrator.frontend.openai_protocol import api_error

log = logging.getLogger(__name__)


class TokenText:
    """A token's text: its decoded piece, or `token_id:<id>` without a tokenizer or when
    the request set return_tokens_as_token_ids (vLLM's form)."""

    def __init__(self, tokenizer, as_ids: bool = False):
        self.tokenizer = None if as_ids else tokenizer

    def __call__(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def chat_entry(self, e: TokenLogprobs) -> dict:
        def one(token_id: int, logprob: float) -> dict:
            text = self(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
        return {**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}


class CompletionLogprobs:
    """The legacy completions logprobs object of one delta; text offsets run on across a
    sample's deltas."""

    def __init__(self, tokenizer, as_ids: bool):
        self.text = TokenText(tokenizer, as_ids)
        self.offsets: dict[int, int] = {}

    def of(self, d: Delta) -> dict:
        entries = d.logprobs or []
        tokens = [self.text(e.token_id) for e in entries]
        offsets, at = [], self.offsets.get(d.index, 0)
        for t in tokens:
            offsets.append(at)
            at += len(t)
        self.offsets[d.index] = at
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self.text(t): lp for t, lp in e.top} for e in entries],
                "text_offset": offsets}


def merge_completion_logprobs(acc: dict | None, new: dict) -> dict:
    if acc is None:
        return new
    return {key: acc[key] + new[key] for key in acc}


def sse(events: AsyncIterator[dict], slot: Slot) -> StreamingResponse:
    """Server-sent events: each chunk as `data: <json>`, then `data: [DONE]`; an error
    after the stream began is sent as one `data: {"error": ...}` event. `slot` (the
    request's admission) is released when the stream ends."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
        except Exception as exc:
            error = api_error(exc)
            if error.status >= 500:
                log.error("stream failed: %s", exc)
            yield f"data: {json.dumps(error.body())}\n\n"
        finally:  # also when the client goes away: its samples are aborted at once
            await events.aclose()
            slot.release()
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
