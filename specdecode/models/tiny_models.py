"""Small random Llama models for tests and benchmarks (nothing in the services uses them).

A test imports it as `specdecode.models.tiny_models`, and so does a benchmark run as
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
    # False: attention's output is zeroed, so a position's logits depend on its own token
    # only; greedy decoding then follows a fixed map and soon cycles, which an n-gram
    # proposer predicts exactly (every proposal accepted).
    attention: bool = True


def build_tiny_model(spec: TinyModelSpec = TinyModelSpec()) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.hidden_size * 2, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).eval()
    if not spec.attention:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
    return model


def byte_tokenizer():
    """A byte-level tokenizer: ids 0-255 are the bytes, 256 is the end-of-sequence token
    `<eos>` (a vocabulary of 257 for TinyModelSpec). Every text tokenizes, so tiny models
    can serve structured output (grammars need a tokenizer) at a tiny model's speed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = pre_tokenizers.ByteLevel.alphabet()  # byte-level BPE's printable stand-ins
    order = sorted(symbols, key=lambda c: _byte_of(c))
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(order)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


def _byte_of(symbol: str) -> int:
    """GPT-2's byte-level table: the byte a printable stand-in symbol represents."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    code = ord(symbol)
    if code < 256 and code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]
