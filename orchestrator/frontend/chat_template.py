"""A conversation as prompt text, through the tokenizer's chat template (POST
/v1/chat/completions, and /tokenize with messages)."""

from __future__ import annotations

from orchestrator.frontend.openai_protocol import APIError, ChatMessage
from orchestrator.frontend.request import RequestLimits


def message_overhead(tokenizer) -> tuple[int, int]:
    """What the chat template adds to each message, in tokens (at least 1) and bytes: the
    text one more empty message adds. Tokenized alone, it may take one token more than
    beside its neighbours, so one is taken off (the bound stays a lower bound). (1, 0)
    without a template or when it refuses two messages in a row."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return 1, 0
    empty = {"role": "user", "content": ""}
    try:
        one, two = (tokenizer.apply_chat_template([empty] * n, tokenize=False,
                                                  add_generation_prompt=False) for n in (1, 2))
    except Exception:  # e.g. a template that requires roles to alternate
        return 1, 0
    if not two.startswith(one):
        return 1, 0
    extra = two[len(one):]
    tokens = len(tokenizer.encode(extra, add_special_tokens=False))
    return max(1, tokens - 1), len(extra.encode())


def render_chat(tokenizer, limits: RequestLimits, messages: list[ChatMessage],
                add_generation_prompt: bool = True) -> str:
    """The conversation through the tokenizer's chat template, its size bounded first
    (the template's work grows with the messages). APIError 400 naming the field."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "messages: this server's tokenizer has no chat template; use "
                            "/v1/completions", param="messages")
    plain = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):  # content parts: text only
            if any(p.get("type") != "text" for p in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported",
                               param=f"messages[{i}].content")
            content = "".join(p.get("text", "") for p in content)
        message = {"role": m.role, "content": content or ""}
        if isinstance(getattr(m, "name", None), str):  # OpenAI's participant name
            message["name"] = m.name
        plain.append(message)
    limits.check_messages(plain)
    try:
        return tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt,
                                             tokenize=False)
    except Exception as exc:  # the template refused the conversation (e.g. roles)
        raise APIError(400, f"messages: {exc}", param="messages") from None
