"""`[model]` and its tables (`[model.moe]`, `[model.mla]`, `[model.mtp]`,
`[model.linear_attention]`): the sections that describe the network (docs/configuration.md);
the rest of the config is in sections.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

# The model families kiln builds (kiln/model/registry.py maps each to its folder; docs/models.md).
# Llama covers Llama 3.x, Qwen3 dense, Mixtral, Qwen3-MoE and gpt-oss: they differ by keys.
# qwen3_next: the hybrid of Gated DeltaNet (linear attention) and gated full attention layers.
ModelFamilyName = Literal["llama", "deepseek_v3", "qwen3_next"]
MODEL_FAMILIES = get_args(ModelFamilyName)
RopeScaling = Literal["none", "llama3", "yarn"]
MoeRouter = Literal["softmax_topk", "sigmoid"]
# Hugging Face's names for a layer's attention (`layer_types`); "linear_attention" is a Gated
# DeltaNet layer (family qwen3_next).
AttentionLayerType = Literal["full_attention", "sliding_attention", "linear_attention"]
# The Gated DeltaNet kernel: "auto" takes fla-core's on CUDA when it is installed, else the
# plain-torch chunked one.
DeltaRuleKernel = Literal["auto", "torch", "fla"]
# The routed experts' activation: SwiGLU, or gpt-oss's clamped SwiGLU (moe.swiglu_*).
ExpertActivation = Literal["swiglu", "clamped_swiglu"]


@dataclass
class MoEConfig:
    """`[model.moe]`: Mixture of Experts (num_experts = 0: dense). Block i is MoE when
    i >= first_dense_layers and (i - first_dense_layers) is a multiple of frequency. Older
    recipes spell these keys flat in [model] (`num_experts`, `moe_<key>`): kiln/config/load.py
    moves them here, with a note."""

    num_experts: int = 0
    top_k: int = 2
    frequency: int = 1
    first_dense_layers: int = 0
    # Hidden width of one expert (0: [model] ffn_hidden_dim); shared experts are one SwiGLU of
    # shared_experts times that width, optionally behind a sigmoid gate (Qwen2-MoE).
    ffn_hidden_dim: int = 0
    shared_experts: int = 0
    shared_expert_gate: bool = False
    # "softmax_topk" or "sigmoid" scores; the chosen experts' scores, renormalized to sum 1
    # (route_norm) and times route_scale, weight their outputs.
    router: MoeRouter = "softmax_topk"
    route_norm: bool = True
    route_scale: float = 1.0
    # Group-limited routing (DeepSeek-V3): tokens only go to experts of their best topk_groups
    # of n_groups groups.
    n_groups: int = 1
    topk_groups: int = 1
    # Load balancing: Switch/GShard auxiliary loss, DeepSeek-V3 sequence-wise auxiliary loss,
    # ST-MoE router z-loss, DeepSeek-V3 auxiliary-loss-free bias updates (0: off).
    aux_loss_weight: float = 0.0
    seq_aux_loss_weight: float = 0.0
    router_z_loss_weight: float = 0.0
    bias_update_rate: float = 0.0
    # 0: dropless; > 0: an expert takes at most ceil(factor · tokens · top_k / num_experts)
    # assignments, lower token indices first, and drops the rest.
    capacity_factor: float = 0.0
    # gpt-oss: biases on the router and the experts' projections, and the clamped SwiGLU
    # (gate clamped to at most swiglu_limit, up to ±swiglu_limit; (up + 1) · gate ·
    # sigmoid(swiglu_alpha · gate)).
    bias: bool = False
    activation: ExpertActivation = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


@dataclass
class MLAConfig:
    """`[model.mla]`: multi-head latent attention (DeepSeek-V2/V3; family deepseek_v3). Queries
    go through a low-rank latent of q_lora_rank (0: one full projection, V2-Lite), keys and
    values are expanded from one latent of kv_lora_rank; each head's query and key are a
    non-rotary part of qk_nope_head_dim and a rotary part of qk_rope_head_dim (the key's rotary
    part one for all heads); values are v_head_dim wide."""

    q_lora_rank: int = 0
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128


@dataclass
class MTPConfig:
    """`[model.mtp]`: multi-token prediction (DeepSeek-V3; family deepseek_v3). `depth` extra
    modules each predict one token further ahead; their mean loss, times loss_weight, joins the
    training loss (0: off; inference and export never run them)."""

    depth: int = 0
    loss_weight: float = 0.3


@dataclass
class LinearAttentionConfig:
    """`[model.linear_attention]`: the Gated DeltaNet layers of family qwen3_next (Hugging
    Face's linear_* keys). Each of num_key_heads query/key heads serves num_value_heads /
    num_key_heads value heads; a short causal depthwise convolution of conv_kernel taps runs over
    queries, keys and values first; the chunked kernel works in chunks of chunk_size tokens."""

    num_key_heads: int = 16
    num_value_heads: int = 32
    key_head_dim: int = 128
    value_head_dim: int = 128
    conv_kernel: int = 4
    chunk_size: int = 64
    kernel: DeltaRuleKernel = "auto"


@dataclass
class ModelConfig:
    # Which family's modules, parallel plan and Hugging Face adapters build the model.
    family: ModelFamilyName = "llama"
    preset: str = ""
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    # Width of one attention head (0: dim / n_heads). Qwen3 decouples it: 32 heads of 128 on
    # dim 2048 make queries 4096 wide.
    head_dim: int = 0
    vocab_size: int = 4096
    ffn_hidden_dim: int = 768
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # "llama3": Llama 3.1's frequency scaling for contexts beyond rope_original_max_seq_len
    # (the factors below are Llama 3.1's; they apply only with "llama3").
    rope_scaling: RopeScaling = "none"
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    # "yarn" (DeepSeek-V3): YaRN's ramp between beta_slow and beta_fast rotations over the
    # original context, and its attention scale from mscale and mscale_all_dim.
    rope_yarn_beta_fast: float = 32.0
    rope_yarn_beta_slow: float = 1.0
    rope_yarn_mscale: float = 1.0
    rope_yarn_mscale_all_dim: float = 0.0
    # YaRN's ramp ends rounded to whole rotary dimensions (DeepSeek-V3), or not (gpt-oss).
    rope_yarn_truncate: bool = True
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    qk_norm: bool = False
    # Biases on the attention's q, k, v and output projections (gpt-oss).
    attention_bias: bool = False
    # Sliding-window attention: a query sees itself and the sliding_window - 1 tokens before it
    # (0: no window). The layers it applies to: `layer_types`, one per layer as Hugging Face
    # names them, or every layer when empty.
    sliding_window: int = 0
    layer_types: list[AttentionLayerType] = field(default_factory=list)
    # A learned logit per head that joins every query's softmax and takes its share of the
    # attention without adding a value (gpt-oss's attention sinks).
    attention_sinks: bool = False
    # Family qwen3_next: the full attention's query projection also makes a per-head gate and
    # the output is multiplied by its sigmoid before wo; RoPE turns only the first
    # partial_rotary_factor of each head's dims; RMSNorms compute x̂·(1 + w), w starting at 0.
    attention_output_gate: bool = False
    partial_rotary_factor: float = 1.0
    norm_zero_centered: bool = False
    init_std: float = 0.02
    # Mixture of Experts: the [model.moe] table (num_experts = 0: dense).
    moe: MoEConfig = field(default_factory=MoEConfig)
    # Family deepseek_v3: its attention and its extra prediction modules.
    mla: MLAConfig = field(default_factory=MLAConfig)
    mtp: MTPConfig = field(default_factory=MTPConfig)
    # Family qwen3_next: its Gated DeltaNet layers (layer_types "linear_attention").
    linear_attention: LinearAttentionConfig = field(default_factory=LinearAttentionConfig)

    @property
    def resolved_head_dim(self) -> int:
        """The width of one attention head: `head_dim`, or dim / n_heads when it is 0."""
        return self.head_dim or self.dim // self.n_heads

    @property
    def rotary_dim(self) -> int:
        """The dims of each head RoPE turns: the first partial_rotary_factor of head_dim (as
        Hugging Face rounds it, down)."""
        return int(self.resolved_head_dim * self.partial_rotary_factor)

    def is_linear_attention_layer(self, layer: int) -> bool:
        """Whether block `layer` mixes tokens by Gated DeltaNet instead of softmax attention."""
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    def attention_window(self, layer: int) -> int:
        """The sliding window of block `layer`'s attention; 0: it attends to the whole context."""
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return 0
        return self.sliding_window

    @property
    def expert_hidden_dim(self) -> int:
        """The hidden width of one expert: `moe.ffn_hidden_dim`, or the dense `ffn_hidden_dim`."""
        return self.moe.ffn_hidden_dim or self.ffn_hidden_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` has a Mixture-of-Experts feed-forward instead of a dense one."""
        moe = self.moe
        if moe.num_experts <= 0 or moe.frequency <= 0 or layer < moe.first_dense_layers:
            return False
        return (layer - moe.first_dense_layers) % moe.frequency == 0
