"""torchtitan's trainer on one variant of benchmarks/gpu_side_by_side.py (torchtitan 0.2.x API).

torchtitan's configs name only its own Llama flavors, so this registers kiln's shapes as a train
spec of their own ("kiln_bench") through torchtitan's Python API: its Llama 3 model, its
parallelize function (per-block compile, float8 conversion, autocast in one process), its
optimizer, scheduler and loss; the batches are kiln's tokens read up front (no tokenizer, no
Hugging Face dataset), the same ones the other two sides train on. Then it runs torchtitan's
Trainer as its train.py does, one process, and writes each logged window's throughput to
--result in the shape of kiln's metrics.jsonl records.

    python benchmarks/torchtitan_launcher.py --model llama3_1b --mode "bf16 compiled" \
        --batch 4 --seq 2048 --steps 20 --log-every 5 --result /tmp/tt.json
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path

from gpu_side_by_side import MODES, Variant, job_config
from side_by_side_workers import read_batches, run_parser

SPEC = "kiln_bench"


def model_args(m, seq: int):
    """torchtitan's TransformerModelArgs of kiln's ModelConfig `m`. torchtitan derives the
    feed-forward width from dim (8·dim/3, rounded up to `multiple_of`): with multiple_of set to
    kiln's width, the rounding lands exactly on it."""
    from torchtitan.models.llama3 import TransformerModelArgs

    if m.ffn_hidden_dim < int(8 * m.dim / 3):
        raise SystemExit(f"ffn_hidden_dim {m.ffn_hidden_dim} < 8·dim/3: not expressible here")
    return TransformerModelArgs(
        dim=m.dim,
        n_layers=m.n_layers,
        n_heads=m.n_heads,
        n_kv_heads=m.n_kv_heads,
        vocab_size=m.vocab_size,
        multiple_of=m.ffn_hidden_dim,
        ffn_dim_multiplier=None,
        norm_eps=m.norm_eps,
        rope_theta=m.rope_theta,
        max_seq_len=seq,
    )


def register(cfg, batches: list[tuple]) -> None:
    """The train spec: torchtitan's Llama 3 pieces, kiln's shapes and batches."""
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.models.llama3 import Transformer, parallelize_llama
    from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

    class KilnBatches(BaseDataLoader):
        """The batches read up front, in order, over and over."""

        def __init__(self):
            self.position = 0

        def __iter__(self):
            while True:
                inputs, labels = batches[self.position % len(batches)]
                self.position += 1
                yield {"input": inputs}, labels

        def state_dict(self) -> dict:
            return {"position": self.position}

        def load_state_dict(self, state: dict) -> None:
            self.position = state["position"]

    spec = TrainSpec(
        model_cls=Transformer,
        model_args={"bench": model_args(cfg.model, cfg.train.seq_len)},
        parallelize_fn=parallelize_llama,
        pipelining_fn=None,
        build_optimizers_fn=build_optimizers,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=lambda **_: KilnBatches(),
        build_tokenizer_fn=None,
        build_loss_fn=build_cross_entropy_loss,
    )
    register_train_spec(SPEC, spec)


def trainer_args(cfg, mode: str, steps: int, log_every: int, dump: str) -> list[str]:
    """torchtitan's command line for the same run: AC none, fp32 weights with bf16 autocast
    (its one-process mixed precision), compile of blocks and loss (its defaults) when
    compiled, tensorwise float8 with the output head kept in bf16 for FP8."""
    precision, compiled = MODES[mode]
    argv = [
        *("--model.name", SPEC, "--model.flavor", "bench", "--job.dump_folder", dump),
        *("--training.local_batch_size", str(cfg.train.batch_size)),
        *("--training.seq_len", str(cfg.train.seq_len), "--training.steps", str(steps)),
        *("--training.max_norm", str(cfg.train.grad_clip_norm)),
        *("--training.mixed_precision_param", "bfloat16", "--training.dtype", "float32"),
        *("--activation_checkpoint.mode", "none", "--metrics.log_freq", str(log_every)),
        *("--optimizer.lr", str(cfg.optimizer.lr), "--optimizer.eps", str(cfg.optimizer.eps)),
        *("--optimizer.weight_decay", str(cfg.optimizer.weight_decay)),
        *("--optimizer.beta1", str(cfg.optimizer.betas[0])),
        *("--optimizer.beta2", str(cfg.optimizer.betas[1])),
        *("--lr_scheduler.warmup_steps", "2"),
    ]
    if compiled:
        argv.append("--compile.enable")
    if precision == "fp8":
        argv += ["--model.converters", "quantize.linear.float8"]
        argv += ["--quantize.linear.float8.recipe_name", cfg.fp8.recipe]
        argv += ["--quantize.linear.float8.filter_fqns", "output"]
    return argv


class Records:
    """A torchtitan metric logger keeping each logged window as kiln's records name it."""

    def __init__(self):
        self.rows: list[dict] = []

    def log(self, metrics: dict, step: int) -> None:
        self.rows.append(
            {
                "step": step,
                "tokens_per_sec": metrics["throughput(tps)"],
                "loss": metrics["loss_metrics/global_avg_loss"],
                "peak_mem_gb": metrics["memory/max_active(GiB)"] * 2**30 / 1e9,
            }
        )

    def close(self) -> None:
        pass


def one_process_group() -> None:
    """The environment torchrun would give one process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for key, value in env.items():
        os.environ.setdefault(key, value)


def main() -> None:
    args = run_parser(__doc__.split("\n")[0]).parse_args()
    cfg = job_config(Variant(args.model, args.mode, args.batch, args.seq, args.layers), args)
    batches = read_batches(cfg, args.steps)
    one_process_group()
    import torch
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger
    from torchtitan.train import Trainer

    init_logger()
    register(cfg, batches)
    dump = tempfile.mkdtemp(prefix="kiln-sbs-torchtitan-")
    config = ConfigManager().parse_args(
        trainer_args(cfg, args.mode, args.steps, args.log_every, dump)
    )
    trainer = Trainer(config)
    records = Records()
    trainer.metrics_processor.logger = records  # no TensorBoard or W&B here: nothing replaced
    try:
        trainer.train()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    peak = max((r["peak_mem_gb"] for r in records.rows), default=None)
    Path(args.result).write_text(json.dumps({"records": records.rows, "peak_mem_gb": peak}))


if __name__ == "__main__":
    main()
