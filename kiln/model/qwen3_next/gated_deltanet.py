"""The Gated DeltaNet layer (Qwen3-Next's linear attention): projections, a short causal
convolution with SiLU over queries, keys and values, L2-normalised queries and keys, the gated
delta rule (delta_rule.py), a gated RMSNorm and the output projection.

Each of the num_key_heads query/key heads serves num_value_heads / num_key_heads consecutive value
heads. The projections are separate matrices (Hugging Face fuses them in in_proj_qkvz and
in_proj_ba) so that tensor parallel can split each by heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from kiln.config.sections import ModelConfig
from kiln.model.qwen3_next.context_parallel import (
    ChunkLinks,
    conv_silu_across_chunks,
    delta_rule_across_chunks,
)
from kiln.model.qwen3_next.delta_rule import Kernel, causal_depthwise_conv, gated_delta_rule
from kiln.model.qwen3_next.norms import GatedRMSNorm
from kiln.model.qwen3_next.short_conv import conv_silu

# Inside the square root of the L2 norm of queries and keys, as Hugging Face and fla-core add it.
L2_EPS = 1e-6


def local(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter split by heads (the whole one outside tensor parallel)."""
    return param.to_local() if isinstance(param, DTensor) else param


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(Σx² + 1e-6) over the last dim, computed in fp32."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + L2_EPS)).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        a = cfg.linear_attention
        self.key_dim, self.value_dim = a.key_head_dim, a.value_head_dim
        self.kernel, self.chunk_size = a.kernel, a.chunk_size
        keys, values = a.num_key_heads * a.key_head_dim, a.num_value_heads * a.value_head_dim
        self.wq = nn.Linear(cfg.dim, keys, bias=False)
        self.wk = nn.Linear(cfg.dim, keys, bias=False)
        self.wv = nn.Linear(cfg.dim, values, bias=False)
        self.wz = nn.Linear(cfg.dim, values, bias=False)
        self.wb = nn.Linear(cfg.dim, a.num_value_heads, bias=False)
        self.wa = nn.Linear(cfg.dim, a.num_value_heads, bias=False)
        # Depthwise taps per channel, oldest first (Hugging Face's conv1d.weight[:, 0]).
        self.conv_q = nn.Parameter(torch.empty(keys, a.conv_kernel))
        self.conv_k = nn.Parameter(torch.empty(keys, a.conv_kernel))
        self.conv_v = nn.Parameter(torch.empty(values, a.conv_kernel))
        self.A_log = nn.Parameter(torch.empty(a.num_value_heads))
        self.dt_bias = nn.Parameter(torch.empty(a.num_value_heads))
        self.norm = GatedRMSNorm(a.value_head_dim, cfg.norm_eps)
        self.wo = nn.Linear(values, cfg.dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        *,
        cache=None,
        layer: int = 0,
        document_starts: torch.Tensor | None = None,
        links: ChunkLinks | None = None,
    ) -> torch.Tensor:
        """x (batch, seq, dim) -> (batch, seq, dim). `document_starts` (batch, seq): True at
        each packed document's first token, where the convolution and the state start afresh;
        `cache`: a `GenerationCache` (state.py) whose convolution inputs and state this layer
        continues from and updates; `links`: context parallel's, x this rank's two chunks of
        each sequence (context_parallel.py)."""
        batch, seq, _ = x.shape
        projected = (self.wq(x), self.wk(x), self.wv(x))
        if links is not None:
            q, k, v = (
                conv_silu_across_chunks(p, local(w), links, kernel=self.kernel)
                for p, w in zip(projected, (self.conv_q, self.conv_k, self.conv_v), strict=True)
            )
        else:
            q, k, v = (
                self._conv(p, w, cache, (layer, name), document_starts, self.kernel)
                for p, w, name in zip(
                    projected, (self.conv_q, self.conv_k, self.conv_v), "qkv", strict=True
                )
            )
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = l2_normalize(q.view(batch, seq, -1, self.key_dim))
        k = l2_normalize(k.view(batch, seq, -1, self.key_dim))
        v = v.view(batch, seq, -1, self.value_dim)
        group = v.shape[2] // q.shape[2]
        q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
        beta = torch.sigmoid(self.wb(x).float())
        # The log of each step's decay, <= 0; in fp32, where exp(A_log) cannot overflow.
        decay = -local(self.A_log).float().exp() * F.softplus(
            self.wa(x).float() + local(self.dt_bias).float()
        )
        options = {"scale": self.key_dim**-0.5, "chunk_size": self.chunk_size}
        if links is not None:
            out = delta_rule_across_chunks(
                q, k, v, decay, beta, links=links, kernel=self.kernel, **options
            )
        else:
            state = cache.recurrent.get(layer) if cache is not None else None
            out, state = gated_delta_rule(
                q,
                k,
                v,
                decay,
                beta,
                initial_state=state,
                output_final_state=cache is not None,
                document_starts=document_starts,
                kernel=self.kernel,
                **options,
            )
            if cache is not None:
                cache.recurrent[layer] = state
        gate = self.wz(x).view(batch, seq, -1, self.value_dim)
        if torch.is_grad_enabled():
            # Recomputed in backward from its two bf16 inputs: written out in fp32, the gated
            # norm would keep 16 bytes per value channel and token, a third of the layer's.
            out = checkpoint(self._gated_norm, out, gate, use_reentrant=False)
        else:
            out = self.norm(out, gate=gate)
        return self.wo(out.reshape(batch, seq, -1))

    def _gated_norm(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The gated norm, its inputs positional: what the checkpoint saves, and tensor
        parallel's input style lays out the first."""
        return self.norm(out, gate=gate)

    @staticmethod
    def _conv(
        x: torch.Tensor,
        weight: torch.Tensor,
        cache,
        key: tuple[int, str],
        document_starts: torch.Tensor | None,
        kernel: Kernel,
    ) -> torch.Tensor:
        """silu(causal depthwise convolution of x), continuing from the cached last inputs in
        generation (zeros before the first token, as the convolution's padding)."""
        weight = local(weight)
        if cache is None:
            return conv_silu(x, weight, document_starts=document_starts, kernel=kernel)
        before = cache.conv.get(key)
        joined = torch.cat([before.to(x.dtype), x], dim=1) if before is not None else x
        cache.conv[key] = joined[:, max(joined.shape[1] - (weight.shape[-1] - 1), 0) :]
        return F.silu(causal_depthwise_conv(joined, weight)[:, -x.shape[1] :])
