"""KV-cache bookkeeping for the decoders, in one place: :class:`CachedLM`.

Rows of a batch may hold *holes*: rejected draft positions (and left padding) stay in the cache with
attention-mask 0 and are never re-run, and every row keeps its own position counter, so each row accepts
its own number of tokens and stays exact.

Two ways to run the model behind the same bookkeeping:

- **lean** (Llama, Mistral and Qwen2 models, the default where it applies): one preallocated key/value
  tensor per model, written in place, and a forward pass over the model's own modules (its norms,
  projections, rotary embedding and MLP) with one ``scaled_dot_product_attention`` per layer, in the
  manner of gpt-fast. It gives the same logits as the model's ``forward`` and skips the per-call
  cost of building masks and cache objects, which dominates batch-1 decoding of small models.
- **hf**: the model's ``forward`` with a ``DynamicCache``, for every other architecture.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from distillspec.errors import DistillSpecError

#: Architectures whose decoder layer is ``h + attn(norm(h))``, ``h + mlp(norm(h))`` with rotary q/k.
LEAN_MODEL_TYPES = ("llama", "mistral", "qwen2")


def supports_lean(model: PreTrainedModel) -> bool:
    """Whether :class:`CachedLM` can run ``model`` on its own preallocated cache."""
    cfg = model.config
    inner = getattr(model, "model", None)
    return (
        cfg.model_type in LEAN_MODEL_TYPES
        and getattr(cfg, "sliding_window", None) is None
        and all(t == "full_attention" for t in (getattr(cfg, "layer_types", None) or []))
        and inner is not None
        and hasattr(inner, "rotary_emb")
        and _rope(model) is not None
    )


def _rope(model: PreTrainedModel):
    """The model's own rotary function: its modeling module's ``apply_rotary_pos_emb`` (None if it has none)."""
    return getattr(sys.modules[type(model.model.layers[0].self_attn).__module__], "apply_rotary_pos_emb", None)


class CachedLM:
    """A causal LM with a KV cache whose rows may hold holes (rejected positions).

    ``mask`` [B, cache_len] marks valid cache columns; ``next_pos`` [B] is each row's next position id.
    ``lean`` picks the forward pass (see the module docstring); None means lean where the model supports it.
    """

    def __init__(self, model: PreTrainedModel, *, lean: bool | None = None) -> None:
        if lean and not supports_lean(model):
            raise DistillSpecError(
                f"lean=True but model type {model.config.model_type!r} is not one of {LEAN_MODEL_TYPES} "
                "with full attention: leave lean unset to use the model's own forward"
            )
        self.model = model
        self.lean = supports_lean(model) if lean is None else lean
        self.cache = None if self.lean else DynamicCache(config=model.config)
        self.rope = _rope(model) if self.lean else None
        self.keys: Tensor | None = None  # lean: [layers, B, kv_heads, capacity, head_dim]
        self.values: Tensor | None = None
        self.mask: Tensor | None = None
        self.next_pos: Tensor | None = None
        self.calls = 0

    @torch.inference_mode()
    def prefill(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Run the (left-padded) prompt; return the logits of its last position, [B, V]."""
        self.mask = attention_mask.long()
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self.next_pos = self.mask.sum(-1)
        return self._forward(input_ids, positions, last_only=True)[:, -1]

    @torch.inference_mode()
    def step(self, tokens: Tensor, valid: Tensor | None = None) -> Tensor:
        """Append ``tokens`` [B, k] (``valid`` marks real ones; others become holes); return logits [B, k, V]."""
        valid = torch.ones_like(tokens) if valid is None else valid.long()
        positions = self.next_pos[:, None] + (valid.cumsum(-1) - 1).clamp(min=0)
        self.mask = valid if self.mask is None else torch.cat([self.mask, valid], dim=-1)
        self.next_pos = self.next_pos + valid.sum(-1)
        return self._forward(tokens, positions)

    @torch.inference_mode()
    def reject_tail(self, n_rejected: Tensor) -> None:
        """Turn the last ``n_rejected[b]`` cache columns of each row into holes."""
        width = int(n_rejected.max()) if n_rejected.numel() else 0
        if width == 0:
            return
        cols = torch.arange(width, 0, -1, device=self.mask.device)  # distance from the end: width..1
        hole = cols[None, :] <= n_rejected[:, None]
        self.mask[:, -width:] = self.mask[:, -width:].masked_fill(hole, 0)
        self.next_pos = self.next_pos - n_rejected
        self._crop_common_tail()

    @torch.inference_mode()
    def select_rows(self, rows: Tensor) -> None:
        """Keep only ``rows`` of the batch (finished rows leave the batch)."""
        if self.lean:
            self.keys, self.values = self.keys[:, rows], self.values[:, rows]
        else:
            self.cache.batch_select_indices(rows)
        self.mask, self.next_pos = self.mask[rows], self.next_pos[rows]
        self._crop_common_tail()

    def _crop_common_tail(self) -> None:
        valid_cols = self.mask.any(0).nonzero()
        keep = int(valid_cols[-1]) + 1 if len(valid_cols) else 0
        if keep < self.mask.shape[1]:
            if not self.lean:  # the lean cache just rewrites those columns next time
                self.cache.crop(keep - self.mask.shape[1])  # HF v5: a negative count removes tokens
            self.mask = self.mask[:, :keep]

    def _forward(self, tokens: Tensor, positions: Tensor, last_only: bool = False) -> Tensor:
        self.calls += 1
        if self.lean:
            return self._lean_forward(tokens, positions, last_only)
        out = self.model(
            input_ids=tokens,
            attention_mask=self.mask,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
        )
        return out.logits.float()

    def _reserve(self, length: int, batch: int, layer) -> None:
        """Grow the preallocated cache (doubling) so it holds ``length`` columns."""
        cap = 0 if self.keys is None else self.keys.shape[3]
        if self.keys is not None and length <= cap:
            return
        attn, w = layer.self_attn, layer.self_attn.k_proj.weight
        shape = (len(self.model.model.layers), batch, w.shape[0] // attn.head_dim, max(length, 2 * cap, 64))
        keys, values = (w.new_zeros(*shape, attn.head_dim) for _ in range(2))
        if self.keys is not None:
            keys[:, :, :, :cap], values[:, :, :, :cap] = self.keys, self.values
        self.keys, self.values = keys, values

    def _lean_forward(self, tokens: Tensor, positions: Tensor, last_only: bool) -> Tensor:
        inner = self.model.model
        batch, k = tokens.shape
        end = self.mask.shape[1]  # the new tokens are the last k cache columns
        start = end - k
        self._reserve(end, batch, inner.layers[0])
        # Query i (column start + i) sees the valid columns up to its own, and always itself, so that a hole's
        # or a pad's query has one finite score (its output is never used).
        cols = torch.arange(end, device=tokens.device)
        own = (start + torch.arange(k, device=tokens.device))[:, None]
        visible = (self.mask.bool()[:, None, :] & (cols <= own)[None]) | (cols == own)[None]
        visible = visible[:, None]  # [B, 1, k, end]

        h = inner.embed_tokens(tokens)
        cos, sin = inner.rotary_emb(h, positions)
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(batch, k, -1, attn.head_dim).transpose(1, 2)
            key = attn.k_proj(x).view(batch, k, -1, attn.head_dim).transpose(1, 2)
            value = attn.v_proj(x).view(batch, k, -1, attn.head_dim).transpose(1, 2)
            q, key = self.rope(q, key, cos, sin)
            self.keys[i, :, :, start:end], self.values[i, :, :, start:end] = key, value
            o = F.scaled_dot_product_attention(
                q,
                self.keys[i, :, :, :end],
                self.values[i, :, :, :end],
                attn_mask=visible,
                scale=attn.scaling,
                enable_gqa=key.shape[1] != q.shape[1],
            )
            h = h + attn.o_proj(o.transpose(1, 2).reshape(batch, k, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        if last_only:
            h = h[:, -1:]
        return self.model.lm_head(inner.norm(h)).float()
