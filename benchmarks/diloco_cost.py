"""DiLoCo across replica groups on CPU (gloo): what crosses the groups and what it costs in loss.
Parts (e) and (f) of benchmarks/fault_tolerance.py (`--parts e f`), kept here so that file stays
under 500 lines; they use its helpers and its lighthouse and launch (real processes, two groups
of dp_shard=2, lighthouse min_replicas=2, one thread per process). fault_tolerance.md reads it.

(e) Bytes across the groups: every rank started by benchmarks/collective_bytes_kiln.py, which
    counts the buffer of each cross-group all-reduce (torchft's Manager.allreduce) per step and
    kind. Every-step sync against DiLoCo at H = 10, 50, 100 and Streaming DiLoCo (2 fragments,
    H = 50, delay 1), 100 steps of the debug model; with `--bytes-large N`,
    llama3_125m (batch 1) for N steps, every-step and DiLoCo at H = N: one step's and one
    sync's bytes, which the table scales to 100 steps (said so there).
(f) Loss after the same tokens: the debug model, `--loss-steps` steps of the same global batch,
    plain HSDP (one job of 4 ranks, dp_replicate=2 × dp_shard=2), every-step replica groups and
    DiLoCo at H = 10 and 50 (outer lr 0.7, momentum 0.9), for each of `--loss-seeds`
    (train.seed: the initial weights and the data order). The final training loss (the mean
    over the last 10 steps of the groups' mean) and the held-out loss of the final weights
    (eval at the last step, a sync of every DiLoCo arm: Python stdlib sources the demo corpus
    left out, tokenized with its tokenizer).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from benchmarks import collective_bytes_kiln
from benchmarks.fault_tolerance import DEMO_BYTES, ft_args, records
from kiln.data.demo_corpus import stdlib_files, stdlib_texts
from kiln.data.shards import ShardWriter
from kiln.data.tokenizer import encode_ids, load_tokenizer
from kiln.events import read_events
from tests.distributed.launch import kiln_args, start_ranks, wait_all
from tests.support.lighthouse import lighthouse

D = 2  # ranks per group
LAST = 10  # (f): the final loss is the mean over this many last steps


def diloco(sync_every: int, fragments: int = 1, delay: int = 0) -> list[str]:
    return [
        "--fault_tolerance.sync=diloco",
        f"--fault_tolerance.sync_every={sync_every}",
        f"--fault_tolerance.fragments={fragments}",
        f"--fault_tolerance.fragment_sync_delay={delay}",
    ]


BYTES_ARMS = {
    "every_step": [],
    "diloco_h10": diloco(10),
    "diloco_h50": diloco(50),
    "diloco_h100": diloco(100),
    "streaming_h50_f2": diloco(50, fragments=2, delay=1),
}
LOSS_ARMS = {"hsdp": None, "every_step": [], "diloco_h10": diloco(10), "diloco_h50": diloco(50)}
LARGE = ["--model.preset=llama3_125m", "--train.batch_size=1"]


def add_arguments(parser) -> None:
    parser.add_argument(
        "--bytes-large", type=int, default=0, help="(e): llama3_125m steps (0: not run)"
    )
    parser.add_argument(
        "--loss-steps", type=int, default=200, help="(f): steps per run, a multiple of 50"
    )
    parser.add_argument("--loss-seeds", type=int, nargs="+", default=[0, 1, 2], help="(f)")
    parser.add_argument("--loss-warmup", type=int, default=5, help="(f): scheduler warm-up")
    parser.add_argument("--eval-steps", type=int, default=50, help="(f): held-out batches")


def run(args, data: Path, root: Path) -> dict:
    """The runs of the parts asked for; what `print_tables` reads."""
    out = {}
    if "e" in args.parts:
        arms = {"debug": (100, [], BYTES_ARMS)}
        if args.bytes_large:
            n = args.bytes_large
            arms["llama3_125m"] = (n, LARGE, {"every_step": [], f"diloco_h{n}": diloco(n)})
        out["e"] = {
            shape: {
                arm: count_bytes(data, root / f"bytes_{shape}_{arm}", [*shaped, *extra], steps)
                for arm, extra in shape_arms.items()
            }
            for shape, (steps, shaped, shape_arms) in arms.items()
        }
    if "f" in args.parts:
        if args.loss_steps % 50:  # the held-out loss is taken at a sync of every DiLoCo arm
            raise SystemExit(f"--loss-steps {args.loss_steps}: use a multiple of 50")
        heldout = held_out(data, root / "heldout")
        out["f"] = {arm: {} for arm in LOSS_ARMS}
        for seed in args.loss_seeds:
            for arm, extra in LOSS_ARMS.items():
                out["f"][arm][seed] = final_loss(data, root, heldout, args, arm, extra, seed)
                print(f"(f) seed {seed} {arm}: {out['f'][arm][seed]}", flush=True)
    return out


def groups(run_dir: Path, root: Path, data: Path, overrides: list[str], module: str) -> float:
    """Two replica groups of D ranks to the end; their wall seconds."""
    start = time.monotonic()
    with lighthouse(root / f"lighthouse_{run_dir.name}.txt", min_replicas=2) as house:
        procs = [
            start_ranks(
                D,
                kiln_args(run_dir, data, *overrides, *ft_args(house.address, g)),
                root / f"logs_{run_dir.name}_{g}",
                module=module,
            )
            for g in (0, 1)
        ]
        codes = wait_all(procs[0] + procs[1], timeout=1200)
    assert codes == [0] * (2 * D), f"{run_dir.name} failed: logs in {root}"
    for g in (0, 1):
        lost = [
            e for e in read_events(run_dir / f"replica_group_{g}") if e["event"] == "not_committed"
        ]
        assert not lost, f"{run_dir.name}: group {g} had uncommitted steps or syncs: {lost}"
    return time.monotonic() - start


def layout(steps: int) -> list[str]:
    return [
        "--distributed.dp_replicate=2",
        f"--distributed.dp_shard={D}",
        f"--train.max_steps={steps}",
        "--checkpoint.interval=0",
    ]


def count_bytes(data: Path, run_dir: Path, extra: list[str], steps: int) -> dict:
    """(e): one arm's run, counted (`bytes_result`)."""
    module = "benchmarks.collective_bytes_kiln"
    overrides = [*layout(steps), "--scheduler.warmup_steps=0", *extra]  # 2 steps allow no more
    wall = groups(run_dir, run_dir.parent, data, overrides, module)
    result = bytes_result(run_dir, steps)
    print(f"(e) {run_dir.name}: {wall:.0f} s; rank 0: {result['ranks'][0]}", flush=True)
    return result


def bytes_result(run_dir: Path, steps: int) -> dict:
    """(e): a run's counts, per rank (group-major): bytes and calls per kind over its
    committed steps, what ran outside a step, and the calls per buffer size."""
    ranks = []
    for g in (0, 1):
        for rank in collective_bytes_kiln.read(run_dir / f"replica_group_{g}"):
            done = [s for s in rank["steps"] if s["committed"]]
            assert len(done) == steps, f"{run_dir.name}: {len(done)} of {steps} steps committed"
            total = {"bytes": {}, "calls": {}}
            for s in done:
                for what in total:
                    for kind, n in s[what].items():
                        total[what][kind] = total[what].get(kind, 0) + n
            ranks.append(total | {"outside": rank["outside"], "sizes": rank["sizes"]})
    return {"steps": steps, "ranks": ranks}


def held_out(data: Path, out: Path, max_bytes: int = 600_000) -> Path:
    """Stdlib sources the demo corpus (its first DEMO_BYTES) left out, up to `max_bytes`,
    tokenized with its tokenizer: held-out data of the same kind."""
    if out.is_dir():
        return out
    seen, texts, size = set(stdlib_texts(DEMO_BYTES)), [], 0
    for file in stdlib_files():
        text = file.read_text(encoding="utf-8", errors="replace")
        if text and text not in seen and size + len(text) <= max_bytes:
            texts.append(text)
            size += len(text)
    with ShardWriter(out, data / "tokenizer.json") as writer:
        for ids in encode_ids(load_tokenizer(data / "tokenizer.json"), texts):
            writer.add_document(ids)
    return out


def final_loss(data, root, heldout, args, arm: str, extra: list[str] | None, seed: int) -> dict:
    """(f): one run's final training loss (the mean of the last LAST steps, each the mean of
    the groups' logged losses) and held-out loss (the groups' mean), and its wall seconds."""
    run_dir, steps = root / f"loss_{arm}_{seed}", args.loss_steps
    overrides = [
        *layout(steps),
        f"--train.seed={seed}",
        f"--scheduler.warmup_steps={args.loss_warmup}",
        f"--eval.interval={steps}",
        f"--eval.path={heldout}",
        f"--eval.steps={args.eval_steps}",
    ]
    start = time.monotonic()
    if extra is None:
        procs = start_ranks(
            2 * D, kiln_args(run_dir, data, *overrides), root / f"logs_{run_dir.name}"
        )
        assert wait_all(procs, timeout=1200) == [0] * (2 * D), f"{run_dir.name} failed"
        logs = [records(run_dir)]
    else:
        groups(run_dir, root, data, [*overrides, *extra], "kiln")
        logs = [records(run_dir / f"replica_group_{g}") for g in (0, 1)]
    wall = time.monotonic() - start
    assert all(len(log) == steps for log in logs), f"{run_dir.name}: a step not logged"
    loss = [statistics.mean(log[i]["loss"] for log in logs) for i in range(steps)]
    held = statistics.mean(log[-1]["eval/loss"] for log in logs)
    return {"train": statistics.mean(loss[-LAST:]), "eval": held, "wall_s": round(wall, 1)}


def print_tables(out: dict, args) -> None:
    for shape, arms in out.get("e", {}).items():
        bytes_table(shape, arms)
    if "f" in out:
        loss_table(out["f"], args)


def bytes_table(shape: str, arms: dict) -> None:
    print(f"\n(e) {shape}: buffer bytes per 100 steps; 2 groups × dp_shard={D}")
    print(
        "| arm | per rank: gradients or pseudo-gradients, MB | per rank: per-step sums, bytes | "
        "per group, all, MB | calls per rank | ratio to every-step | how |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    every_step = None
    for arm, big, small, calls, how in bytes_rows(arms):
        per_group = statistics.mean(
            sum(big[g * D : (g + 1) * D] + small[g * D : (g + 1) * D]) for g in (0, 1)
        )
        every_step = every_step or per_group
        print(
            f"| {arm} | {_range([b / 1e6 for b in big], ',.2f')} | {_range(small, ',.0f')} | "
            f"{per_group / 1e6:,.2f} | {calls:g} | {per_group / every_step:.4f} | {how} |"
        )
    for arm, result in arms.items():
        sizes = {
            k: dict(sorted(v.items(), key=lambda kv: -int(kv[0])))
            for k, v in result["ranks"][0]["sizes"].items()
        }
        print(f"{arm}, rank 0, calls per buffer size (bytes: calls): {sizes}")


def bytes_rows(arms: dict) -> list[tuple[str, list[float], list[float], float, str]]:
    """Per 100 steps, per rank (group-major): the gradients' or pseudo-gradients' bytes, the
    per-step sums' bytes, and the calls (mean over ranks). Measured over 100 steps; from fewer,
    the every-step arm's steps (each alike) scaled, and DiLoCo's sync (of the whole model)
    scaled to H = 10, 50, 100: said in the row."""
    rows = []
    for arm, result in arms.items():
        steps, ranks = result["steps"], result["ranks"]
        other = {k for r in ranks for k in r["bytes"] if k.startswith("other")}
        outside = [r["outside"]["bytes"] for r in ranks if r["outside"]["bytes"]]
        assert not other and not outside, f"{arm}: collectives not attributed: {other} {outside}"
        big = [
            r["bytes"].get("gradients", 0) + r["bytes"].get("pseudo_gradients", 0) for r in ranks
        ]
        small = [r["bytes"].get("per_step_sums", 0) for r in ranks]
        calls = statistics.mean(sum(r["calls"].values()) for r in ranks)
        if steps == 100:
            scales = [(arm, 1.0, "measured")]
        elif arm == "every_step":
            scales = [(arm, 100 / steps, f"{steps} steps measured, × {100 / steps:g}")]
        else:
            syncs = ranks[0]["calls"]["pseudo_gradients"]
            scales = [
                (f"diloco_h{h}", 100 / h / syncs, f"{syncs} sync measured, × {100 / h:g}")
                for h in (10, 50, 100)
            ]
        for name, k, how in scales:
            rows.append((name, [b * k for b in big], [b * k for b in small], calls * k, how))
    return rows


def _range(values: list[float], fmt: str) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:{fmt}}" if f"{lo:{fmt}}" == f"{hi:{fmt}}" else f"{lo:{fmt}}-{hi:{fmt}}"


def loss_table(arms: dict, args) -> None:
    seeds = args.loss_seeds
    print(
        f"\n(f) debug model, {args.loss_steps} steps of 16 × 64 tokens, warm-up "
        f"{args.loss_warmup}; train: mean of the last {LAST} steps; held-out: "
        f"{args.eval_steps} batches at the last step"
    )
    print(
        "| arm | " + " | ".join(f"seed {s}" for s in seeds) + " | mean (min-max) | "
        "gap to every-step, % per seed | s per run |"
    )
    print("|---|" + "---:|" * (len(seeds) + 3))
    for key in ("train", "eval"):
        for arm, runs in arms.items():
            values = [runs[s][key] for s in seeds]
            gaps = [100 * (runs[s][key] / arms["every_step"][s][key] - 1) for s in seeds]
            walls = statistics.median(runs[s]["wall_s"] for s in seeds)
            print(
                f"| {arm} ({key}) | " + " | ".join(f"{v:.4f}" for v in values)
                + f" | {statistics.mean(values):.4f} ({min(values):.4f}-{max(values):.4f}) | "
                + ", ".join(f"{g:+.2f}" for g in gaps) + f" | {walls:.0f} |"
            )  # fmt: skip
