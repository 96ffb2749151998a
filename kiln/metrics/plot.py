"""Loss curve PNG from metrics.jsonl: training loss and, where logged, the held-out eval loss.
Drawn at every checkpoint and at the end of a run; `kiln plot RUN_DIR` redraws it."""

from __future__ import annotations

from pathlib import Path

from kiln.config import JobConfig
from kiln.metrics.logger import GROUP_DIR_PREFIX, JSONL_NAME, read_metrics

CURVE_NAME = "loss_curve.png"


def redraw_loss_curve(cfg: JobConfig) -> Path | None:
    """<run_dir>/loss_curve.png from the run's metrics.jsonl, if metrics.plot is on."""
    run_dir = Path(cfg.metrics.run_dir)
    if not cfg.metrics.plot:
        return None
    return plot_loss_curve(run_dir / JSONL_NAME, run_dir / CURVE_NAME)


def plot_loss_curve(metrics_path: Path, out_path: Path) -> Path | None:
    records = read_metrics(metrics_path)
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    steps = [r["step"] for r in records]
    ax.plot(
        steps,
        [r["loss"] for r in records],
        linewidth=0.8,
        alpha=0.5,
        label="loss of the logged step",
    )
    ax.plot(
        steps,
        [r["loss_avg"] for r in records],
        marker=".",
        linewidth=1.5,
        label="mean since the previous log",
    )
    evals = [(r["step"], r["eval/loss"]) for r in records if r.get("eval/loss") is not None]
    if evals:
        ax.plot(*zip(*evals, strict=True), marker="o", linewidth=1.2, label="eval loss (held out)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    folder = Path(metrics_path).parent
    # A replica group's folder is named after its run too (fault tolerance).
    grouped = folder.name.startswith(GROUP_DIR_PREFIX)
    name = f"{folder.parent.name}/{folder.name}" if grouped else folder.name
    ax.set_title(f"{name}: mean loss {records[0]['loss_avg']:.3f} → {records[-1]['loss_avg']:.3f}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)
    return Path(out_path)
