"""Small random Llama models for tests and benchmarks (nothing in the services uses them).

A test imports it as `specdecode.tiny_models`, and so does a benchmark run as
`python bench/<script>.py`: both find it where the package is installed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM


@dataclass(frozen=True)
class TinyModelSpec:
    """A small random Llama for tests and benchmarks: same vocab ⇒ a valid draft/target pair."""

    seed: int = 0
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    max_position_embeddings: int = 256
    # Larger than the usual 0.02 so logits are well separated: greedy argmax is then not
    # decided by float rounding differences between batched and unbatched kernels.
    initializer_range: float = 0.3


def build_tiny_model(spec: TinyModelSpec = TinyModelSpec()) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.hidden_size * 2, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(spec.seed)
    return LlamaForCausalLM(config).eval()
