"""Autoregressive decoding with a KV cache: greedy, or sampling with temperature, top-k and top-p."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln.config.sections import ModelConfig
from kiln.errors import KilnError
from kiln.model.kv_cache import KVCache


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    seed: int = 0,
    stop: Callable[[list[int]], bool] | None = None,
) -> list[int]:
    """Continue `prompt_ids` and return only the new tokens (the eos token included if reached).

    temperature 0 is greedy; otherwise logits are divided by the temperature, filtered to the
    `top_k` most likely tokens (0: all) and to the smallest set holding `top_p` of the
    probability mass, then sampled with a generator seeded by `seed`. Generation also stops
    when the context reaches model.cfg.max_seq_len, and once `stop(new tokens so far)` is true
    (stop sequences: the evaluation harness's `until`).
    """
    cfg = model.cfg
    _check_args(
        cfg.vocab_size, cfg.max_seq_len, prompt_ids, max_new_tokens, temperature, top_k, top_p
    )
    # The last new token is never fed back, so it needs no position of its own.
    n_new = min(max_new_tokens, cfg.max_seq_len - len(prompt_ids) + 1)
    if n_new <= 0:
        return []
    param = next(model.parameters())
    max_len, dtype = len(prompt_ids) + n_new - 1, _activation_dtype(param)
    if hasattr(model, "generation_cache"):
        # A family whose layers keep more than keys and values (qwen3_next's recurrent states).
        cache = model.generation_cache(batch=1, max_len=max_len, device=param.device, dtype=dtype)
    else:
        heads, key_dim, value_dim = cache_widths(cfg)
        cache = KVCache(
            n_layers=cfg.n_layers,
            batch=1,
            n_kv_heads=heads,
            head_dim=key_dim,
            value_dim=value_dim,
            max_len=max_len,
            device=param.device,
            dtype=dtype,
        )
    generator = torch.Generator(device=param.device).manual_seed(seed)
    logits = model(torch.tensor([prompt_ids], device=param.device), cache)[0, -1]
    new: list[int] = []
    while True:
        token = _next_token(logits, temperature, top_k, top_p, generator)
        new.append(token)
        if token == eos_id or len(new) == n_new or (stop is not None and stop(new)):
            return new
        logits = model(torch.tensor([[token]], device=param.device), cache)[0, -1]


def cache_widths(cfg: ModelConfig) -> tuple[int, int, int]:
    """The heads, key width and value width a layer caches per token: the key-value heads of
    grouped-query attention, or every head of multi-head latent attention (family deepseek_v3),
    whose keys (qk_nope + qk_rope) and values (v_head_dim) are cached expanded."""
    if cfg.family == "deepseek_v3":
        mla = cfg.mla
        return cfg.n_heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.v_head_dim
    return cfg.n_kv_heads, cfg.resolved_head_dim, cfg.resolved_head_dim


def _activation_dtype(param: torch.Tensor) -> torch.dtype:
    """Keys and values come out in the autocast dtype when generating under autocast (as
    `kiln generate` does on GPU); caching them in fp32 would double the cache for nothing."""
    if torch.is_autocast_enabled(param.device.type):
        return torch.get_autocast_dtype(param.device.type)
    return param.dtype


def _check_args(
    vocab_size: int,
    max_seq_len: int,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
) -> None:
    if not prompt_ids:
        raise KilnError("the prompt is empty; pass at least one token id")
    if len(prompt_ids) > max_seq_len:
        raise KilnError(
            f"the prompt has {len(prompt_ids)} tokens, more than the model's context of "
            f"{max_seq_len} (model.max_seq_len); shorten the prompt"
        )
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise KilnError(
            f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size}); "
            "was the prompt encoded with this model's tokenizer?"
        )
    if max_new_tokens < 0:
        raise KilnError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise KilnError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k < 0:
        raise KilnError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    if not 0 < top_p <= 1:
        raise KilnError(f"top_p must be in (0, 1] (1 disables it), got {top_p}")


def _next_token(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator,
) -> int:
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k > 0:
        kth_largest = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p < 1:
        logits = _top_p_filter(logits, top_p)
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p."""
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    # A token is dropped when the tokens ranked above it already reach top_p; the most likely
    # token always has zero mass above it, so it is always kept.
    drop_sorted = probs.cumsum(dim=-1) - probs >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
