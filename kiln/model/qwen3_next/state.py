"""What generation keeps between forwards of a hybrid model: a KV cache for the full-attention
layers, and for each Gated DeltaNet layer its recurrent state and its convolution's last inputs
(a fixed size, however long the context)."""

from __future__ import annotations

import torch

from kiln.config.sections import ModelConfig
from kiln.model.kv_cache import KVCache


class GenerationCache:
    """The KVCache interface the attention layers use (`pos`, `update`, `advance`), over the
    full-attention layers only, and the Gated DeltaNet layers' states: `recurrent[layer]`
    (batch, value heads, key_dim, value_dim) and `conv[(layer, "q" | "k" | "v")]`, the last
    conv_kernel − 1 inputs of each convolution (batch, tokens, channels); absent before the
    first forward."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        batch: int,
        max_len: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ):
        full = [i for i in range(cfg.n_layers) if not cfg.is_linear_attention_layer(i)]
        self._slot = {layer: slot for slot, layer in enumerate(full)}
        self.kv = KVCache(
            n_layers=len(full),
            batch=batch,
            n_kv_heads=cfg.n_kv_heads,
            head_dim=cfg.resolved_head_dim,
            max_len=max_len,
            device=device,
            dtype=dtype,
        )
        self.recurrent: dict[int, torch.Tensor] = {}
        self.conv: dict[tuple[int, str], torch.Tensor] = {}

    @property
    def pos(self) -> int:
        """Tokens seen so far."""
        return self.kv.pos

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store full-attention layer `layer`'s keys and values; return all so far."""
        return self.kv.update(self._slot[layer], k, v)

    def advance(self, n: int) -> None:
        self.kv.advance(n)
