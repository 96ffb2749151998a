"""One-process CPU step time of the debug model in its Llama and Qwen3 shapes, in two checkouts
of kiln side by side: before and after a change (issue 37: the model-family boundary and the
training step's dense core with hooks). Also counts what a reader meets: the lines of
`TrainStep` and the modules outside kiln/model/ that know about Mixture-of-Experts.

Each measurement is one process (`Trainer.train_step`, as `kiln train` runs it) timing --steps
steps after --warmup; the rounds alternate between the checkouts and the models, so drift in the
machine's load hits all alike. The table gives the median over rounds of each process's mean
step time, and after / before.

    python benchmarks/models.py --before f4764cd [--rounds 5 --steps 20 --data data/demo]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Both shapes on the debug model (dim 128, 4 heads, 2 KV heads, 2 blocks). Qwen3's own head
# width (head_dim) did not exist before the change, so the Qwen3 shape here keeps dim / n_heads.
MODELS = {
    "llama (debug)": [],
    "qwen3 (debug: qk_norm, tied)": ["--model.qk_norm=true", "--model.tie_embeddings=true"],
}
TIMER = """
import json, sys, tempfile, time
from kiln.config import load_config
from kiln.train.trainer import Trainer
steps, warmup, overrides = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
run_dir = tempfile.mkdtemp(prefix="kiln-models-")
cfg = load_config("configs/train/debug.toml", [*overrides, f"--metrics.run_dir={run_dir}",
                  "--checkpoint.interval=0", "--metrics.log_interval=1000000"])
cfg.train.max_steps = 10**9
trainer = Trainer(cfg)
for _ in range(warmup):
    trainer.train_step()
start = time.perf_counter()
for _ in range(steps):
    trainer.train_step()
print(json.dumps({"ms": 1e3 * (time.perf_counter() - start) / steps}))
"""
MOE_WORDS = re.compile(r"moe|expert", re.IGNORECASE)


def step_ms(checkout: Path, overrides: list[str], *, steps: int, warmup: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "2"}
    out = subprocess.run(
        [sys.executable, "-c", TIMER, str(steps), str(warmup), *overrides],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])["ms"]


def train_step_lines(checkout: Path) -> int:
    """Lines of the class TrainStep and of its hooks (kiln/train/step.py, step_hooks.py,
    moe_step.py where they exist)."""
    tree = ast.parse((checkout / "kiln/train/step.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrainStep"]
    return cls.end_lineno - cls.lineno + 1


def dense_core_lines(checkout: Path) -> int:
    """Lines of TrainStep.__call__, the step as it runs."""
    tree = ast.parse((checkout / "kiln/train/step.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrainStep"]
    (call,) = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__call__"]
    return call.end_lineno - call.lineno + 1


def moe_aware_modules(checkout: Path) -> list[str]:
    """Modules outside kiln/model/ and kiln/config/ whose code (names, attributes, imports,
    keyword arguments; not comments or docstrings) mentions MoE or experts."""
    found = []
    for path in sorted((checkout / "kiln").rglob("*.py")):
        relative = path.relative_to(checkout).as_posix()
        if relative.startswith(("kiln/model/", "kiln/config/")):
            continue
        if any(MOE_WORDS.search(word) for word in _code_words(path)):
            found.append(relative)
    return found


def _code_words(path: Path) -> set[str]:
    words = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            words.add(node.id)
        elif isinstance(node, ast.Attribute):
            words.add(node.attr)
        elif isinstance(node, ast.keyword) and node.arg:
            words.add(node.arg)
        elif isinstance(node, ast.ImportFrom):
            words.update([node.module or "", *(alias.name for alias in node.names)])
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            words.add(node.name)
        elif isinstance(node, ast.Import):
            words.update(alias.name for alias in node.names)
    return words


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--before", required=True, help="git revision of the 'before' checkout")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--data", default="", help="a prepared dataset (default: the recipe's)")
    args = parser.parse_args()
    data = [f"--data.path={args.data}"] if args.data else []

    before = Path(tempfile.mkdtemp(prefix="kiln-before-")) / "kiln"
    subprocess.run(
        ["git", "worktree", "add", "-q", "--detach", str(before), args.before], cwd=REPO, check=True
    )
    checkouts = {"before": before, "after": REPO}
    try:
        times = {(c, m): [] for c in checkouts for m in MODELS}
        for _ in range(args.rounds):
            for model, overrides in MODELS.items():
                for name, checkout in checkouts.items():
                    ms = step_ms(
                        checkout, [*overrides, *data], steps=args.steps, warmup=args.warmup
                    )
                    times[name, model].append(ms)
        print("| model | before (ms/step) | after (ms/step) | after / before |")
        print("|---|---|---|---|")
        for model in MODELS:
            b, a = (statistics.median(times[c, model]) for c in checkouts)
            print(f"| {model} | {b:.2f} | {a:.2f} | {a / b:.3f} |")
        print(
            "\n| checkout | TrainStep lines | TrainStep.__call__ lines | modules outside model/ and config/ naming MoE |"
        )
        print("|---|---|---|---|")
        for name, checkout in checkouts.items():
            modules = moe_aware_modules(checkout)
            print(
                f"| {name} | {train_step_lines(checkout)} | {dense_core_lines(checkout)} | "
                f"{len(modules)}: {', '.join(m.removeprefix('kiln/') for m in modules)} |"
            )
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=REPO, check=False)


if __name__ == "__main__":
    main()
