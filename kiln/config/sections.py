"""One dataclass per config section (docs/architecture.md, "Configuration"). Defaults are what a
user gets by leaving a key out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# [model] and its tables live in model_sections.py (one file would pass 500 lines); importers
# read every section's dataclass and choice from here, as before the split.
from kiln.config.model_sections import (  # noqa: F401
    MODEL_FAMILIES,
    AttentionLayerType,
    DeltaRuleKernel,
    ExpertActivation,
    LinearAttentionConfig,
    MLAConfig,
    ModelConfig,
    ModelFamilyName,
    MoEConfig,
    MoeRouter,
    MTPConfig,
    RopeScaling,
)

# The keys that take one of a few words are typed by a Literal of those words: building a config
# from TOML refuses any other (kiln/config/load.py, `convert`), and so does validation of a config
# built in Python (`choice_problems`). At run time the values are plain strings.

Device = Literal["auto", "cpu", "cuda"]
MixedPrecision = Literal["bf16", "fp32", "fp8"]
ActivationCheckpointing = Literal["none", "full", "selective"]
Loss = Literal["cross_entropy", "chunked_cross_entropy"]
Float8Recipe = Literal["tensorwise", "rowwise"]
Float8HighPrecision = Literal["bf16", "fp32"]
OptimizerName = Literal["adamw", "muon", "lion", "schedule_free_adamw"]
MuonAdjustLr = Literal["original", "match_rms_adamw"]
SchedulerName = Literal["cosine", "linear", "wsd", "constant", "rex", "none"]
DataSource = Literal["demo", "prepared", "hf"]
MixtureSource = Literal["prepared", "hf"]  # a dataset of a mixture: not the demo corpus
GradReduce = Literal["per_micro_batch", "per_step"]
# Context parallel's exchange: every layer all-gathers keys and values, passes them from rank
# to rank and merges the partial results (ring), or re-splits queries, keys and values from the
# sequence to the heads (all-to-all, DeepSpeed-Ulysses).
CpMode = Literal["all_gather", "ring", "all_to_all"]
# Pipeline schedules that run one stage per rank, and those that run several (virtual stages).
SingleStageSchedule = Literal["gpipe", "1f1b"]
MultiStageSchedule = Literal["interleaved_1f1b", "interleaved_zero_bubble", "zbv"]
PipelineSchedule = Literal[SingleStageSchedule, MultiStageSchedule]
AsyncMode = Literal["disabled", "async", "async_process"]
ResumeMode = Literal["auto", "never", "force"]
ExportDtype = Literal["float32", "bfloat16", "float16"]
# Which checkpoints the run also writes as a Hugging Face folder (kiln/checkpoint/hf_export.py).
ExportHf = Literal["never", "final", "every_save"]
NanAction = Literal["stop", "rollback"]
FaultToleranceSync = Literal["every_step", "diloco"]
SpikeAction = Literal["none", "skip"]
BatchRampShape = Literal["linear", "step"]
ScheduleUnit = Literal["steps", "tokens"]
WandbMode = Literal["online", "offline", "disabled"]


@dataclass
class BatchScheduleConfig:
    """`[train.batch_schedule]`: the global batch (in sequences) ramped over the tokens seen, as
    DeepSeek-V3 did; it grows by more micro-batches per step, never by another micro-batch shape
    (docs/configuration.md, "Batch-size schedule"). Empty `tokens`: no ramp."""

    # Points of the ramp: at `tokens[i]` tokens seen the global batch is `sequences[i]`; the
    # first point is at 0 and the last value is the recipe's global batch.
    tokens: list[int] = field(default_factory=list)
    sequences: list[int] = field(default_factory=list)
    # "linear": in between, the line through the points, rounded down to `multiple_of`;
    # "step": each point's batch holds until the next point.
    shape: BatchRampShape = "linear"
    # Every step's global batch is a multiple of this many sequences (0: one micro-batch on
    # every data rank, train.batch_size × data ranks); set it to resume at another layout.
    multiple_of: int = 0


@dataclass
class SeqLenPhase:
    """`[[train.seq_len_schedule]]`: train at `seq_len` until `until_tokens` tokens are seen."""

    seq_len: int = 0
    until_tokens: int = 0
    # Sequences per micro-batch in this phase (0: the recipe's micro-batch tokens,
    # train.batch_size × train.seq_len / seq_len).
    batch_size: int = 0


@dataclass
class TrainConfig:
    # The sequence length; under seq_len_schedule, that of the last (longest) phase.
    seq_len: int = 256
    batch_size: int = 8
    grad_accum_steps: int = 1
    # The run's length and the learning-rate schedule's horizon.
    max_steps: int = 100
    # End this invocation early, with a checkpoint, without touching the schedule (0: off).
    stop_at_step: int = 0
    time_limit_minutes: float = 0.0
    seed: int = 0
    device: Device = "auto"
    mixed_precision: MixedPrecision = "bf16"
    activation_checkpointing: ActivationCheckpointing = "none"
    compile: bool = False
    grad_clip_norm: float = 1.0
    loss: Loss = "cross_entropy"  # or "chunked_cross_entropy": the same loss, never all the logits
    # Tokens whose logits the chunked loss holds at once (ignored by cross_entropy).
    loss_chunk_tokens: int = 2048
    z_loss_weight: float = 0.0
    batch_schedule: BatchScheduleConfig = field(default_factory=BatchScheduleConfig)
    # Shorter sequences first: phases in order, each until its token count; then train.seq_len.
    seq_len_schedule: list[SeqLenPhase] = field(default_factory=list)


@dataclass
class Float8Config:
    """`[fp8]`: with train.mixed_precision = "fp8", the linear layers compute in float8 through
    torchao (docs/fp8.md); everything else in `high_precision`, over fp32 master weights."""

    # "tensorwise": one scale per tensor (fastest; float8 all-gathers under FSDP and TP);
    # "rowwise": one scale per row (more accurate, for outliers).
    recipe: Float8Recipe = "tensorwise"
    # tensorwise under FSDP: gather the weights already cast to float8 (half of bf16's bytes).
    fsdp_float8_all_gather: bool = False
    # What the rest computes in: "bf16", or "fp32" to see float8's own error alone (numerics
    # checks; the parity tests compare layouts this way).
    high_precision: Float8HighPrecision = "bf16"
    # Linear layers kept out of float8 besides the output head and the MoE routers, by name: "wo"
    # keeps every attention output projection, "layers.0" the whole first block.
    keep_high_precision: list[str] = field(default_factory=list)


@dataclass
class AdamWGroupConfig:
    """`[optimizer.adamw]`: under Muon, the AdamW settings of what it does not orthogonalize
    (embeddings, output head, norms, biases). A key left unset takes [optimizer]'s value."""

    lr: float | None = None
    weight_decay: float | None = None
    betas: list[float] | None = None
    eps: float | None = None


@dataclass
class OptimizerConfig:
    # adamw, muon (matrices; AdamW for the rest), lion, schedule_free_adamw.
    name: OptimizerName = "adamw"
    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    # Muon only (unset: 0.95, true, 5, "original", true). adjust_lr: "original" (Jordan) or
    # "match_rms_adamw" (Moonlight: AdamW's lr and weight decay carry over).
    momentum: float | None = None
    nesterov: bool | None = None
    ns_steps: int | None = None
    adjust_lr: MuonAdjustLr | None = None
    # Each matrix orthogonalized by one owner rank that sends it on (true), or by every rank
    # holding it (false).
    owner_compute: bool | None = None
    adamw: AdamWGroupConfig = field(default_factory=AdamWGroupConfig)


@dataclass
class SchedulerConfig:
    name: SchedulerName = "cosine"
    # What the schedule runs over: optimizer steps, or tokens (the tokens of that many steps at
    # the full batch and sequence length: under a batch or sequence-length schedule, the two
    # differ).
    unit: ScheduleUnit = "steps"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    decay_ratio: float = 0.2


@dataclass
class DatasetSource:
    """One `[[data.datasets]]` entry of a mixture; the same source keys as [data] itself."""

    name: str = ""
    source: MixtureSource = "prepared"
    path: str = ""
    weight: float = 1.0
    text_key: str = "text"
    split: str = "train"
    streaming: bool = False


@dataclass
class DataPhase:
    """`[[data.phases]]`: from `start_step` on, sample with these weights (by dataset name) and
    scale the learning rate: data annealing."""

    start_step: int = 0
    weights: dict[str, float] = field(default_factory=dict)
    lr_scale: float = 1.0


@dataclass
class DataConfig:
    # One dataset: source/path (and text_key/split/streaming for "hf"). A mixture: `datasets`.
    source: DataSource = "demo"
    path: str = "data/demo"
    tokenizer: str = ""
    text_key: str = "text"
    split: str = "train"
    streaming: bool = False
    datasets: list[DatasetSource] = field(default_factory=list)
    # Mixture probabilities are weight^(1/temperature), normalized: >1 flattens, <1 sharpens.
    temperature: float = 1.0
    phases: list[DataPhase] = field(default_factory=list)
    # Attention stays within a document and no label crosses into the next one.
    document_mask: bool = False
    # Loader worker processes (0: read in the training process) and steps each prepares ahead.
    num_workers: int = 1
    prefetch_steps: int = 2


@dataclass
class EvalConfig:
    # Every `interval` steps (0: never), `steps` batches of held-out data: eval/loss, perplexity.
    # An eval batch is shaped like a training step (the same global batch, split the same way),
    # so the samples read and the loss are the same whatever the layout.
    interval: int = 0
    steps: int = 10
    # A prepared dataset; empty: the validation split `kiln prepare` wrote at <data.path>/val.
    path: str = ""
    # lm-evaluation-harness tasks (pip install 'kiln[eval]') scored on the training model every
    # `tasks_interval` steps (0: every `interval`), logged as eval/<task>/<metric>. Not under
    # pipeline or context parallel: score checkpoints with `kiln eval CKPT --tasks` there.
    tasks: list[str] = field(default_factory=list)
    tasks_interval: int = 0
    # Examples per task (0: all), few-shot examples (-1: each task's own), a folder of task YAMLs.
    tasks_limit: int = 0
    tasks_num_fewshot: int = -1
    tasks_path: str = ""

    @property
    def effective_tasks_interval(self) -> int:
        """Steps between two evaluations of the tasks (0: never)."""
        return (self.tasks_interval or self.interval) if self.tasks else 0


@dataclass
class DistributedConfig:
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    cp_mode: CpMode = "all_gather"
    ep: int = 1
    grad_reduce: GradReduce = "per_micro_batch"
    # FSDP: free each block's gathered parameters after its forward (True) or keep them until
    # its backward (False: one all-gather per block per step instead of two, ZeRO-2 memory).
    reshard_after_forward: bool = True
    pp_schedule: PipelineSchedule = "1f1b"
    # 0: one sequence per micro-batch, i.e. train.batch_size micro-batches per pipeline pass.
    pp_microbatches: int = 0
    pp_virtual_stages: int = 1
    # Explicit transformer layers per stage (pp × pp_virtual_stages entries); empty: balanced.
    pp_layers_per_stage: list[int] = field(default_factory=list)
    # How many transformer layers the embedding and the output head weigh when balancing stages.
    pp_embedding_layers: int = 1
    pp_output_layers: int = 1


@dataclass
class CheckpointConfig:
    dir: str = ""
    interval: int = 0
    keep_last_n: int = 0
    save_final: bool = True
    # A run that saves holds its checkpoint location (an OWNER file renewed while it lives); when
    # another live run holds it, wait this long for it to end before refusing to start (at most
    # 80% of resilience.collective_timeout_s, which the other ranks wait in meanwhile).
    owner_wait_s: float = 300.0
    async_mode: AsyncMode = "disabled"
    resume: ResumeMode = "auto"
    load_path: str = ""
    model_only: bool = True
    export_dtype: ExportDtype = "float32"
    export_hf: ExportHf = "never"


@dataclass
class ResilienceConfig:
    nan_max_consecutive: int = 3
    nan_action: NanAction = "stop"
    collective_timeout_s: float = 600.0
    step_timeout_s: float = 1800.0
    debug_nan_steps: list[int] = field(default_factory=list)
    # Loss-spike skipping (kiln/resilience/spike_guard.py): "skip" leaves out the update of a step
    # whose loss or gradient norm stands more than its sigmas standard deviations above the mean
    # of the last spike_window applied steps; spike_max_consecutive in a row then stop or roll
    # back as nan_action says.
    spike_action: SpikeAction = "none"
    spike_window: int = 100
    spike_loss_sigmas: float = 6.0
    spike_grad_norm_sigmas: float = 6.0
    spike_max_consecutive: int = 5
    # Check every rank before training (kiln/resilience/health.py): on CUDA a timed bf16 matmul
    # per GPU and its ECC counter, on several ranks a timed all-reduce over the world and each
    # mesh dimension. A rank that fails or never arrives stops the job at start-up, naming it,
    # instead of hanging or failing at the first step's collective.
    preflight: bool = True
    # A health-check collective that has not completed after this long names the ranks that never
    # reached it: short enough to fail fast, long enough for one rank's slow GPU check.
    preflight_timeout_s: float = 120.0
    # A rank that makes the others wait this long in a health-check all-reduce is named slow (a
    # warning): above the skew of a loaded machine's scheduler, below a sick host's.
    preflight_slow_s: float = 2.0
    # A GPU whose matmul rate is below this fraction of the ranks' median is named slow (a
    # warning): identical GPUs differ by a few percent; a throttled one by far more.
    preflight_slow_matmul: float = 0.8


@dataclass
class FaultToleranceConfig:
    """Replica groups with torchft (docs/fault_tolerance.md): each of distributed.dp_replicate
    groups is a torchrun job of its own; a group that dies is dropped and the others train on."""

    enabled: bool = False
    # This process's replica group, 0 .. dp_replicate - 1 (each group's launch sets its own).
    replica_group: int = 0
    # The lighthouse that forms each step's quorum (http://host:29510); empty: $TORCHFT_LIGHTHOUSE.
    lighthouse: str = ""
    # Steps commit only while at least this many groups are in the quorum.
    min_replicas: int = 1
    # How long a step waits for its quorum: past the lighthouse's heartbeat timeout (a dead
    # group is dropped, not waited for) and past a checkpoint save, which the writing group
    # does while the others wait at the next quorum.
    quorum_timeout_s: float = 600.0
    # Collectives across groups fail after this long.
    timeout_s: float = 60.0
    # A rejoining group's transfer of its state from a live peer fails after this long (the
    # whole state of a rank in one stream: size it for the model).
    recovery_timeout_s: float = 600.0
    # Start-up waits this long for the lighthouse before giving up.
    connect_timeout_s: float = 30.0
    # A group gives up after this many steps in a row that could not commit (a recovery that
    # keeps failing, a lost peer in every step) instead of retrying forever.
    max_failed_steps: int = 5
    # How the groups synchronize: every step (HSDP's arithmetic), or DiLoCo (each group trains on
    # its own for sync_every steps, then an outer SGD step with Nesterov momentum on the groups'
    # mean pseudo-gradient; kiln/parallel/diloco.py). fragments > 1: Streaming DiLoCo, one of
    # that many contiguous runs of blocks synchronizing every sync_every / fragments steps, its
    # all-reduce started fragment_sync_delay steps before its outer step.
    sync: FaultToleranceSync = "every_step"
    sync_every: int = 100
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    fragments: int = 1
    fragment_sync_delay: int = 0


@dataclass
class MetricsConfig:
    run_dir: str = "runs/default"
    log_interval: int = 10
    jsonl: bool = True
    plot: bool = True
    # Log every parameter's gradient norm (before clipping) under `param_grad_norms`; one
    # collective per parameter, so a debugging and parity aid rather than a default.
    param_grad_norms: bool = False
    # MoE: warn when an expert has received no token for this many optimizer steps in a row
    # (0: never).
    idle_expert_warn_steps: int = 100
    # Every record of metrics.jsonl also goes, under the same names and from rank 0 only, to
    # TensorBoard (event files in <run_dir>/tensorboard; pip install 'kiln[tb]') and to Weights &
    # Biases (pip install 'kiln[wandb]'), whose run id is kept in <run_dir>/wandb_run_id so that a
    # resumed job continues the same run.
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "kiln"
    wandb_entity: str = ""  # empty: your default entity
    # "online", "offline" (written to <run_dir>/wandb; `wandb sync` uploads it later), "disabled".
    # Online without a network warns once and continues offline.
    wandb_mode: WandbMode = "online"


@dataclass
class ProfilingConfig:
    # torch.profiler traces of steps start_step..end_step (inclusive) on `ranks` (empty: every
    # rank), written to <run_dir>/profile/rank_<r>/ for TensorBoard or Perfetto, with kiln's phases
    # named (data, forward, backward, optimizer, checkpoint, pipeline, all-to-all).
    enabled: bool = False
    start_step: int = 3
    end_step: int = 4
    ranks: list[int] = field(default_factory=lambda: [0])
    # Also record allocations: on CUDA a memory snapshot (<run_dir>/profile/rank_<r>/
    # memory_snapshot.pickle, for pytorch.org/memory_viz), on the CPU the profiler's memory view.
    record_memory: bool = False


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    fp8: Float8Config = field(default_factory=Float8Config)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
