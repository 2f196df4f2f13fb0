"""The forward pass of Llama-family decoders (Llama, Qwen2) over a ragged batch and the KV pool.

It calls the loaded `transformers` model's own modules (embedding, norms, projections, MLP,
rotary embedding, `lm_head` through get_output_embeddings) in the order their decoder layers
do, and replaces only what touches the cache: each layer writes its new keys/values into the
pool in place and attends over the pool through an AttentionBackend. The final norm and the
LM head run on the query positions only. Any other model goes through the runner's generic
path (docs/design.md, Executor).
"""

from __future__ import annotations

import sys

import torch

from specdecode.executor.attention import AttentionBackend, AttnBatch

FAST_MODEL_TYPES = ("llama", "qwen2")


def fast_path_unsupported(model) -> str | None:
    """Why `model` cannot take the fast path, or None when it can."""
    config = model.config
    if config.model_type not in FAST_MODEL_TYPES:
        return f"model type {config.model_type!r} (fast path: {', '.join(FAST_MODEL_TYPES)})"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return "sliding-window layers"
    return None


class LlamaLikeForward:
    """`forward(...)` -> float32 logits [Q, V] for the packed query positions."""

    def __init__(self, model):
        self.model = model
        self.decoder = model.model
        self.layers = list(self.decoder.layers[:model.config.num_hidden_layers])
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.num_heads = model.config.num_attention_heads
        self.num_kv_heads = model.config.num_key_value_heads
        self.scale = attn.scaling
        self._rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 query_index: torch.Tensor, kv: torch.Tensor, backend: AttentionBackend,
                 batch: AttnBatch) -> torch.Tensor:
        """input_ids, positions [N]; query_index [Q] (packed positions whose logits are
        wanted; None: all N); kv the pool [layers, 2, ...]; batch the backend's (an
        AttnBatch, or the StaticRows of a compiled forward)."""
        N, H, Hkv, D = input_ids.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        x = self.decoder.embed_tokens(input_ids)  # [N, hidden]
        cos, sin = self.decoder.rotary_emb(x[None], positions[None])  # [1, N, D]
        cos, sin = cos[0], sin[0]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(N, H, D)
            k = attn.k_proj(h).view(N, Hkv, D)
            v = attn.v_proj(h).view(N, Hkv, D)
            q, k = self._rope(q, k, cos, sin, unsqueeze_dim=1)
            backend.write(kv[i], k, v, batch)
            x = x + attn.o_proj(backend.attend(q, kv[i], batch, self.scale))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        hidden = self.decoder.norm(x if query_index is None else x[query_index])  # [Q, hidden]
        return self.model.get_output_embeddings()(hidden).float()  # [Q, V]
