"""What a model family hands the rest of kiln (docs/models.md): the one boundary through which
the trainer, the step, `kiln/parallel/`, `kiln/checkpoint/` and `kiln/plan/` reach a model.

A family lives in its own folder under `kiln/model/` and describes itself with a `ModelFamily`;
`kiln/model/registry.py` maps `model.family` to it. Nothing here imports torch, so `kiln plan`
and `kiln check` count and plan without loading it: the functions that build modules import
them when called.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from kiln.config.sections import ModelConfig

if TYPE_CHECKING:
    from torch import nn

    from kiln.model.forward_args import StageRole
    from kiln.model.parallel_plan import ParallelPlan


@dataclass(frozen=True)
class ParamCount:
    total: int
    embedding: int
    # Weights of every matrix multiply one token goes through, output head included: with MoE,
    # only its top-k routed experts (and the router and shared experts).
    matmul: int
    # Parameters one token uses: all but the routed experts it is not sent to (= total if dense).
    active: int

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding


@dataclass(frozen=True)
class AttentionTerms:
    """The attention's shape as the planner's memory and communication terms need it."""

    # "gqa": grouped-query attention over whole heads; "mla": multi-head latent attention.
    kind: Literal["gqa", "mla"]
    heads: int
    # Widths per token, all heads together, of the queries, the keys and the values attention
    # takes, and of its output (what wo takes): split over tp by heads.
    query_width: int
    key_width: int
    value_width: int
    output_width: int
    # Weights of one block's attention; the width one layer caches per token for generation
    # (keys and values; MLA: its latent and rotary key, one for all heads); and the width
    # context parallel all-gathers per token (the keys and values attention takes, split over
    # tp by heads).
    params: int
    cached_width: int
    gathered_width: int
    # Low-rank latents every tp rank computes whole (MLA's query and key-value latents, each
    # behind an RMSNorm): their widths summed, and how many norms; the weights tp leaves whole
    # (the down-projections and those norms).
    latent_width: int = 0
    latent_norms: int = 0
    replicated_params: int = 0


@dataclass(frozen=True)
class LinearMixerTerms:
    """Blocks whose token mixer is a linear recurrence, not attention (Gated DeltaNet), as the
    planner's memory terms need them; the model's other blocks are attention (`AttentionTerms`)."""

    layers: int  # how many of the model's blocks
    params: int  # weights of one mixer, an FSDP unit, split over tp by heads
    # Activations one mixer keeps for backward per token, bf16 compute on CUDA with the
    # family's GPU kernel, beyond the block's norm and the normalized input its projections
    # share (counted as attention's are): split over tp by heads.
    kept_bytes_per_token: int


@dataclass(frozen=True)
class HfPart:
    """One Hugging Face tensor, or a half of one, that holds (part of) a kiln tensor.

    expert: the HF tensor is `kiln_tensor[expert]` (one expert of a stacked 3-D parameter).
    half: the kiln tensor is this half (0 or 1) along dim 1 of the HF tensor (a fused
    gate_up_proj: gate first, then up); only read, never written.
    rows: kiln row r is HF row rows[r]: a permutation of all rows (DeepSeek's rotary dimensions,
    interleaved in HF and half-split in kiln), or one part of them where several kiln tensors
    share one HF tensor (Qwen3-Next's fused in_proj_qkvz, each tensor's rows head by head), the
    parts of one HF tensor covering its rows once; export writes every kiln row back to its HF
    row (a copy, not a view).
    copy: the HF tensor repeats another part of the same kiln tensor (DeepSeek-V3's MTP layer
    stores the embedding and head again): written on export, checked equal on import.
    interleave: the kiln tensor is every other entry of the HF tensor's last dim from this one
    (0 or 1: gpt-oss's gate_up_proj alternates gate and up units); written back interleaved.
    transposed: the HF tensor holds the kiln tensor's last two dims swapped (gpt-oss's experts
    are (experts, in, out), kiln's (experts, out, in)).
    singleton: the HF tensor has one more dim, of size 1, at this position (a depthwise Conv1d's
    weight (channels, 1, kernel) against kiln's (channels, kernel)).
    """

    name: str
    expert: int | None = None
    half: int | None = None
    rows: tuple[int, ...] | None = None
    copy: bool = False
    interleave: int | None = None
    transposed: bool = False
    singleton: int | None = None


# kiln name -> the Hugging Face tensors it is made of; a kiln tensor with no parts (the MoE
# router's expert_bias) has no Hugging Face counterpart.
NameMap = dict[str, list[HfPart]]


@dataclass(frozen=True)
class HfAdapter:
    """One Hugging Face architecture, both directions: config.json <-> ModelConfig and the
    tensor names. `config_from_hf` refuses (KilnError naming the key) whatever kiln's model
    would compute differently; `export_problems` says why a kiln model cannot be exported as
    this architecture (empty: it can)."""

    model_type: str
    architecture: str
    config_from_hf: Callable[[dict[str, Any]], ModelConfig]
    hf_config: Callable[[ModelConfig, str, dict[str, tuple[str, int]]], dict[str, Any]]
    import_names: Callable[[ModelConfig, set[str]], NameMap]
    export_names: Callable[[ModelConfig], NameMap]
    export_problems: Callable[[ModelConfig], list[str]]
    # Refuses a built model whose state the architecture cannot hold (e.g. moved routing biases).
    check_export_model: Callable[[nn.Module], None] = lambda model: None
    # (name prefix, what those tensors are) of checkpoint tensors import leaves out, saying so
    # once per prefix: parts of a release kiln does not build (a vision encoder, an MTP layer).
    left_out: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class ModelFamily:
    """A model family: how to build, parallelize, convert and count it."""

    name: str
    # The whole model, or one pipeline stage's part of it, on the current default device
    # (kiln/model/build.py puts it on meta). Its forward takes the arguments the Llama family's
    # does (kiln/model/llama/model.py) and it has `stage`, `init_buffers()`, `init_weights(seed)`
    # and `head_weight()`.
    build: Callable[[ModelConfig, StageRole | None], nn.Module]
    parallel_plan: Callable[[ModelConfig], ParallelPlan]
    # One per Hugging Face architecture this family converts.
    hf_adapters: tuple[HfAdapter, ...]
    # The adapter a kiln model of this family exports as (raises KilnError saying why none fits).
    export_adapter: Callable[[ModelConfig], HfAdapter]
    count_params: Callable[[ModelConfig], ParamCount]
    flops_per_token: Callable[[ModelConfig, int], int]
    attention_terms: Callable[[ModelConfig], AttentionTerms]
    # What runs the family's own layers on a device (torch.device or its name), for the
    # start-up summary; None: kiln's shared attention kernels only.
    kernels: Callable[[ModelConfig, Any], str] | None = None
    # The blocks whose token mixer is not attention; None: every block's is.
    linear_mixer_terms: Callable[[ModelConfig], LinearMixerTerms | None] | None = None
