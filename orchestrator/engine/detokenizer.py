"""A sequence's text as it grows, and its stop strings (the engine's postprocess owns both,
so that a stop string ends the sequence in the step that produced it)."""

from __future__ import annotations


class Detokenizer:
    """Turns a growing list of token ids into text deltas.

    Holds back text that may still change: an incomplete multi-byte character (U+FFFD at
    the end) and a tail that could be the start of a stop string.
    """

    def __init__(self, tokenizer, stop: list[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.sent = 0  # characters already returned

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def stop_at(self, text: str) -> int | None:
        """Where the first stop string not yet sent begins in `text`, or None."""
        found = [at for s in self.stop
                 if (at := text.find(s, max(0, self.sent - len(s) + 1))) != -1]
        return min(found, default=None)

    def stop_token_count(self, output: list[int], new: list[int]) -> int | None:
        """How many of `new` tokens (appended to `output`) complete a stop string, or None
        when they complete none: the tokens after it are not the sequence's."""
        if not self.stop or self.stop_at(self.decode(output + new)) is None:
            return None
        return next(n for n in range(1, len(new) + 1)
                    if self.stop_at(self.decode(output + new[:n])) is not None)

    def _held_back(self, text: str) -> int:
        hold = len(text) - len(text.rstrip("\ufffd"))
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return hold

    def update(self, token_ids: list[int], final: bool) -> str:
        """The new text of the whole output so far, cut before a stop string."""
        text = self.decode(token_ids)
        if (at := self.stop_at(text)) is not None:
            text, final = text[:at], True
        end = len(text) if final else len(text) - self._held_back(text)
        delta = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta
