"""`kiln compare RUN_DIR RUN_DIR ...`: several runs' metric against steps and against tokens in
one PNG, and a table of their final values; for humans, what a parity check compares (two
layouts, two optimizers, a run and its resumed copy)."""

from __future__ import annotations

from pathlib import Path

from kiln.errors import KilnError
from kiln.metrics.logger import JSONL_NAME, metrics_dir, read_metrics, scalars


def load_runs(
    run_dirs: list[Path], metric: str, *, replica_group: int | None = None
) -> dict[str, list[tuple[int, int, float]]]:
    """{label: [(step, tokens seen, value)]} of every record holding `metric`, per run (of a
    fault-tolerance run, one replica group's: `replica_group`, else group 0's)."""
    runs = {}
    for run_dir in map(Path, run_dirs):
        folder = metrics_dir(run_dir, replica_group)
        records = read_metrics(folder / JSONL_NAME)
        if not records:
            raise KilnError(f"{run_dir} has no {JSONL_NAME}: is it a kiln run directory?")
        points = [
            (r["step"], r.get("tokens_seen", 0), values[metric])
            for r in records
            if metric in (values := scalars(r))
        ]
        if not points:
            known = sorted({name for r in records for name in scalars(r)})
            raise KilnError(f"{run_dir} logged no {metric!r}; its metrics are: {', '.join(known)}")
        label = _label(run_dir, runs)
        runs[label if folder == run_dir else f"{label}/{folder.name}"] = points
    return runs


def compare_runs(
    run_dirs: list[Path], *, metric: str, out: Path, replica_group: int | None = None
) -> str:
    """Draw `out` and return the table of final values (the first run is the reference)."""
    runs = load_runs(run_dirs, metric, replica_group=replica_group)
    _plot(runs, metric, out)
    reference = next(iter(runs.values()))[-1][2]
    rows = [("run", "steps", "tokens", f"final {metric}", f"min {metric}", "vs first")]
    for label, points in runs.items():
        final = points[-1][2]
        change = f"{final - reference:+.4g}" if label != next(iter(runs)) else ""
        rows.append(
            (
                label,
                str(points[-1][0]),
                f"{points[-1][1]:,}",
                f"{final:.6g}",
                f"{min(p[2] for p in points):.6g}",
                change,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        for row in rows
    ]
    return "\n".join(line.rstrip() for line in lines)


def _label(run_dir: Path, taken: dict) -> str:
    """The run dir's name, or its last two parts where two runs share a name."""
    label = run_dir.name
    return label if label not in taken else f"{run_dir.parent.name}/{run_dir.name}"


def _plot(runs: dict[str, list[tuple[int, int, float]]], metric: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_tokens) = plt.subplots(1, 2, figsize=(11, 4), dpi=120, sharey=True)
    for label, points in runs.items():
        steps, tokens, values = zip(*points, strict=True)
        by_step.plot(steps, values, linewidth=1.2, label=label)
        by_tokens.plot(tokens, values, linewidth=1.2, label=label)
    by_step.set_xlabel("step")
    by_tokens.set_xlabel("tokens seen")
    by_step.set_ylabel(metric)
    for ax in (by_step, by_tokens):
        ax.grid(alpha=0.3)
    by_step.legend()
    fig.suptitle(f"{metric}: {', '.join(runs)}")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
