"""`kiln plot` and `kiln compare`: views of finished or running runs."""

from __future__ import annotations

from kiln.cli.common import docs
from kiln.errors import KilnError

REPLICA_GROUP_HELP = (
    "of a fault-tolerance run (docs/fault_tolerance.md), the replica group whose metrics to read "
    "(default: group 0, or the lowest that logged); each group logs its own under "
    "RUN_DIR/replica_group_<G>/"
)


def add_parsers(subcommand) -> None:
    plot = subcommand(
        "plot",
        help="redraw a run's loss curve (training and eval loss) into RUN_DIR/loss_curve.png",
        epilog=docs("observability.md"),
    )
    plot.add_argument(
        "run_dir",
        help="a run directory (metrics.run_dir); of a fault-tolerance run, replica group 0's "
        "curve is drawn, into RUN_DIR/replica_group_0/",
    )
    plot.add_argument("--replica-group", type=int, metavar="G", help=REPLICA_GROUP_HELP)
    plot.set_defaults(run=cmd_plot)
    compare = subcommand(
        "compare",
        help="plot several runs' loss (or another metric) against steps and tokens, and print "
        "their final values",
        epilog=docs("observability.md"),
    )
    compare.add_argument(
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        help="run directories (metrics.run_dir), each with its metrics.jsonl; the first is the "
        "reference the others' final values are compared with. A fault-tolerance run is read "
        "through replica group 0's metrics (RUN_DIR/replica_group_0/)",
    )
    compare.add_argument("--replica-group", type=int, metavar="G", help=REPLICA_GROUP_HELP)
    compare.add_argument(
        "--metric", default="loss", help="a metrics.jsonl name, e.g. eval/loss, grad_norm"
    )
    compare.add_argument("--out", default="compare.png", help="where the PNG goes")
    compare.set_defaults(run=cmd_compare)


def cmd_plot(args) -> int:
    from pathlib import Path

    from kiln.metrics.logger import JSONL_NAME, metrics_dir
    from kiln.metrics.plot import CURVE_NAME, plot_loss_curve

    run_dir = Path(args.run_dir)
    folder = metrics_dir(run_dir, args.replica_group)
    curve = plot_loss_curve(folder / JSONL_NAME, folder / CURVE_NAME)
    if curve is None:
        raise KilnError(f"{run_dir} has no {JSONL_NAME} with records: is it a kiln run directory?")
    print(f"kiln: loss curve {curve}")
    return 0


def cmd_compare(args) -> int:
    from pathlib import Path

    from kiln.metrics.compare import compare_runs

    runs = [Path(d) for d in args.run_dirs]
    print(
        compare_runs(runs, metric=args.metric, out=Path(args.out), replica_group=args.replica_group)
    )
    print(f"kiln: plot {args.out}")
    return 0
