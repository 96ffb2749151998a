"""Where the records of metrics.jsonl also go: TensorBoard and Weights & Biases.

Rank 0 alone writes them, under the names metrics.jsonl uses: a list (one value per MoE layer
or per expert) becomes `name/0`, `name/1`, ..., a dict (per-parameter gradient norms)
`name/key`. A resumed run writes into the same TensorBoard directory (its events from the
resumed step on replace the interrupted attempt's, as in metrics.jsonl) and the same W&B run,
whose id is kept in the run dir.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

from kiln.config import JobConfig, to_toml
from kiln.log import warn

TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"


class Backend(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def open_backends(cfg: JobConfig, *, start_step: int) -> list[Backend]:
    """The backends `cfg.metrics` enables, for a run that continues after `start_step`."""
    run_dir = Path(cfg.metrics.run_dir)
    backends: list[Backend] = []
    if cfg.metrics.tensorboard:
        backends.append(TensorBoardBackend(run_dir, cfg, start_step=start_step))
    if cfg.metrics.wandb and cfg.metrics.wandb_mode != "disabled":
        backends.append(WandbBackend(run_dir, cfg))
    return backends


class TensorBoardBackend:
    def __init__(self, run_dir: Path, cfg: JobConfig, *, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard hides the interrupted attempt's events from this step on.
        self.writer = SummaryWriter(
            log_dir=str(run_dir / TENSORBOARD_DIR), purge_step=start_step + 1
        )
        self.writer.add_text("config", f"```toml\n{to_toml(cfg)}\n```", global_step=start_step)

    def log(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()  # a preempted job keeps every logged line

    def close(self) -> None:
        self.writer.close()


class WandbBackend:
    def __init__(self, run_dir: Path, cfg: JobConfig):
        import wandb

        m = cfg.metrics
        id_file = run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(6)
        mode = m.wandb_mode
        if mode == "online":
            blocker = _online_blocker()
            if blocker is not None:
                warn(f"W&B cannot log online ({blocker}); logging offline to {run_dir / 'wandb'}")
                mode = "offline"
        self.run = wandb.init(
            project=m.wandb_project,
            entity=m.wandb_entity or None,
            id=run_id,
            resume="allow",
            name=run_dir.name,
            dir=str(run_dir),
            mode=mode,
            config=dataclasses.asdict(cfg),
        )
        id_file.write_text(run_id + "\n")

    def log(self, step: int, values: dict[str, float]) -> None:
        # W&B keeps one record per step and ignores steps at or before the last one it has:
        # steps a resumed run logs again (the same losses, kiln resumes bitwise) keep their first
        # record there.
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def _online_blocker() -> str | None:
    """Why online logging cannot work here, or None: no API key, or the server is unreachable."""
    if not os.environ.get("WANDB_API_KEY") and not _netrc_has_key():
        return "no API key: run `wandb login` or set WANDB_API_KEY"
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    host, port = url.hostname or "api.wandb.ai", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError as error:
        return f"{host}:{port} is unreachable: {error}"
    return None


def _netrc_has_key() -> bool:
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="replace")
