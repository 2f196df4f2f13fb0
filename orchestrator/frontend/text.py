"""Incremental detokenization with stop strings, for streaming text deltas."""

from __future__ import annotations


class TextStream:
    """Turns a growing list of token ids into text deltas.

    Holds back text that may still change: an incomplete multi-byte character (U+FFFD at
    the end) and a tail that could be the start of a stop string.
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.sent = 0  # characters already returned
        self.stopped = False  # a stop string was found

    def _held_back(self, text: str) -> int:
        hold = len(text) - len(text.rstrip("\ufffd"))
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return hold

    def update(self, token_ids: list[int], final: bool) -> str:
        """The new text for the whole output so far; sets `stopped` at a stop string."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        for s in self.stop:
            at = text.find(s, max(0, self.sent - len(s) + 1))
            if at != -1:
                text, final, self.stopped = text[:at], True, True
        end = len(text) if final else len(text) - self._held_back(text)
        delta = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta
