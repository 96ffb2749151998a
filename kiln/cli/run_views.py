"""`kiln plot` and `kiln compare`: views of finished or running runs."""

from __future__ import annotations

from kiln.cli.common import docs
from kiln.errors import KilnError


def add_parsers(subcommand) -> None:
    plot = subcommand(
        "plot",
        help="redraw a run's loss curve (training and eval loss) into RUN_DIR/loss_curve.png",
        epilog=docs("observability.md"),
    )
    plot.add_argument("run_dir", help="a run directory (metrics.run_dir)")
    plot.set_defaults(run=cmd_plot)
    compare = subcommand(
        "compare",
        help="plot several runs' loss (or another metric) against steps and tokens, and print "
        "their final values",
        epilog=docs("observability.md"),
    )
    compare.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    compare.add_argument(
        "--metric", default="loss", help="a metrics.jsonl name, e.g. eval/loss, grad_norm"
    )
    compare.add_argument("--out", default="compare.png", help="where the PNG goes")
    compare.set_defaults(run=cmd_compare)


def cmd_plot(args) -> int:
    from pathlib import Path

    from kiln.metrics.logger import JSONL_NAME
    from kiln.metrics.plot import CURVE_NAME, plot_loss_curve

    run_dir = Path(args.run_dir)
    curve = plot_loss_curve(run_dir / JSONL_NAME, run_dir / CURVE_NAME)
    if curve is None:
        raise KilnError(f"{run_dir} has no {JSONL_NAME} with records: is it a kiln run directory?")
    print(f"kiln: loss curve {curve}")
    return 0


def cmd_compare(args) -> int:
    from pathlib import Path

    from kiln.metrics.compare import compare_runs

    print(compare_runs([Path(d) for d in args.run_dirs], metric=args.metric, out=Path(args.out)))
    print(f"kiln: plot {args.out}")
    return 0
