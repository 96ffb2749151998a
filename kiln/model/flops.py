"""Parameter counts and honest training FLOPs per token (DESIGN §9), in one place."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.config.sections import ModelConfig


@dataclass(frozen=True)
class ParamCount:
    total: int
    embedding: int
    matmul: int  # weights of every matrix multiply, output head included

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding


def count_params(cfg: ModelConfig) -> ParamCount:
    d, hd = cfg.dim, cfg.head_dim
    attention = d * cfg.n_heads * hd + 2 * d * cfg.n_kv_heads * hd + cfg.n_heads * hd * d
    mlp = 3 * d * cfg.ffn_hidden_dim
    norms = 2 * d + (2 * hd if cfg.qk_norm else 0)
    embedding = cfg.vocab_size * d
    head = cfg.vocab_size * d
    total = (
        embedding
        + cfg.n_layers * (attention + mlp + norms)
        + d
        + (0 if cfg.tie_embeddings else head)
    )
    return ParamCount(
        total=total, embedding=embedding, matmul=cfg.n_layers * (attention + mlp) + head
    )


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Forward + backward FLOPs per trained token: 6 per matmul weight plus causal attention.

    Attention scores and values cost 12·L·S·D per token without a mask; causal halves that.
    The embedding lookup is a gather, not a matmul, and is not counted.
    """
    return 6 * count_params(cfg).matmul + 6 * cfg.n_layers * seq_len * cfg.n_heads * cfg.head_dim
