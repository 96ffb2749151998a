"""Loss curve PNG from metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

from kiln.metrics.logger import read_metrics


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
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend()
    name = Path(metrics_path).parent.name
    ax.set_title(f"{name}: mean loss {records[0]['loss_avg']:.3f} → {records[-1]['loss_avg']:.3f}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)
    return Path(out_path)
