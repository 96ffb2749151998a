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
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], marker=".", linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(
        f"{Path(metrics_path).parent.name}: loss {records[0]['loss']:.3f} → {records[-1]['loss']:.3f}"
    )
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)
    return Path(out_path)
