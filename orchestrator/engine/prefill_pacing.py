"""Prefill pacing: how many prompt tokens a step may carry beside decoding sequences, so
that a step with prompt work costs about SLOWDOWN decode-only steps (docs/design.md,
chunked prefill).

The token budget (`--max-num-batched-tokens`) bounds a step's work in tokens, but what a
running stream feels is time: on a small model a 256-token chunk at a 4,000-token context
costs 10x a decode step (measured: 3 ms decode steps, 20-48 ms chunk steps). So the prompt
tokens of a step beside decoders are also paced by time: the pace is corrected after every
such step by how far its duration was from SLOWDOWN x a decode-only step (a moving
average), by at most a factor 2 up or down, and never below MIN_CHUNK (prompts always
progress). With no decoding sequence in a step nothing is paced: nobody waits for it.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_CHUNK = 16  # smallest prefill chunk worth a place in a step
SLOWDOWN = 2.0  # a step with prompt work aims at this many decode-only steps' time


@dataclass
class PrefillPacer:
    tokens: int = 4 * MIN_CHUNK  # prompt tokens allowed beside decoders in the next step
    decode_step_s: float | None = None  # moving average of decode-only steps
    smoothing: float = 0.2

    def observe(self, seconds: float, prompt_tokens: int, decoding: int) -> None:
        """A step took `seconds`; it carried `prompt_tokens` prompt tokens to compute and
        `decoding` decoding sequences."""
        if decoding and not prompt_tokens:
            avg = self.decode_step_s
            self.decode_step_s = seconds if avg is None else avg + self.smoothing * (seconds - avg)
        elif decoding and prompt_tokens and self.decode_step_s:
            # Time above a decode step, in decode steps, corrected towards SLOWDOWN - 1:
            # down from what this step carried, up only when the pace was what held it back.
            excess = max(seconds / self.decode_step_s - 1.0, 0.05)
            scale = min(2.0, max(0.5, (SLOWDOWN - 1.0) / excess))
            if scale < 1.0:
                self.tokens = max(MIN_CHUNK, int(min(prompt_tokens, self.tokens) * scale))
            elif prompt_tokens >= self.tokens:
                self.tokens = int(self.tokens * scale)

    def cap(self) -> int | None:
        """Prompt tokens allowed beside decoders; None until a decode step was timed."""
        return self.tokens if self.decode_step_s is not None else None
