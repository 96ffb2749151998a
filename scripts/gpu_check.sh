#!/bin/bash
# kiln's check of a new GPU machine, in one command, from a plain checkout (nothing installed):
# the environment, the GPU test suite (tests/gpu), then benchmarks/gpu_side_by_side.py, each part
# under its own time limit so a hang cannot eat the budget (11 minutes on one H200 in all).
#
#   scripts/gpu_check.sh OUTDIR [--wheels DIR] [--cpu-dry-run]
#
# OUTDIR receives report.md (read this), results.json (raw), gpu_tests.xml (JUnit), the
# benchmark's side_by_side.{md,json} and each part's log. --wheels DIR (or KILN_GPU_WHEELS=DIR)
# installs the wheels in DIR into a temporary folder put on PYTHONPATH, with
# `pip install --no-index --no-deps --target`: for a machine without network (torchao,
# torchtitan and what they need; docs/gpu_check.md lists them). Without a GPU it writes a report
# that says so, runs no test, and exits 0; --cpu-dry-run then also runs the benchmark's CPU dry
# run (the debug model, a few steps), which checks the script itself.
#
# The Python: $PYTHON, else the checkout's .venv (`make install`) where it has one, else python3;
# one that cannot import torch, kiln's packages or pytest is named in one line (exit 2).
# Limits in seconds (environment variables): KILN_CHECK_TESTS_S (450), KILN_CHECK_BENCH_S (190).
# KILN_CHECK_BENCH_ARGS adds arguments to the benchmark's (e.g. "--rounds 3 --models llama3_1b").
# Exit status: 0 when every part that ran passed, 1 when a test failed, a part failed or timed
# out, 2 on wrong usage or an unusable Python.
# See docs/gpu_check.md.

set -uo pipefail

usage() {
    echo "usage: scripts/gpu_check.sh OUTDIR [--wheels DIR] [--cpu-dry-run]" >&2
    exit 2
}

log() { echo "gpu_check: $*"; }

out=""
wheels="${KILN_GPU_WHEELS:-}"
cpu_dry_run=0
while (($#)); do
    case "$1" in
    --wheels)
        (($# >= 2)) || usage
        wheels="$2"
        shift 2
        ;;
    --wheels=*)
        wheels="${1#--wheels=}"
        shift
        ;;
    --cpu-dry-run)
        cpu_dry_run=1
        shift
        ;;
    -h | --help) usage ;;
    -*) usage ;;
    *)
        [[ -z "$out" ]] || usage
        out="$1"
        shift
        ;;
    esac
done
[[ -n "$out" ]] || usage

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
    python=python3
    [[ -x "$repo/.venv/bin/python" ]] && python="$repo/.venv/bin/python"
fi
tests_limit="${KILN_CHECK_TESTS_S:-450}"
bench_limit="${KILN_CHECK_BENCH_S:-190}"
started=$SECONDS
status=0

# The repo runs from its checkout; carried wheels come first.
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
cd "$repo" || exit 2

if [[ -n "$wheels" ]]; then
    site="$(mktemp -d "${TMPDIR:-/tmp}/kiln-gpu-check-site.XXXXXX")"
    shopt -s nullglob
    found=("$wheels"/*.whl)
    shopt -u nullglob
    if ((${#found[@]} == 0)); then
        log "no wheels in $wheels"
        exit 2
    fi
    log "installing ${#found[@]} wheels from $wheels into $site"
    if ! "$python" -m pip install -q --no-index --no-deps --no-compile --target "$site" \
        "${found[@]}" >"$out/wheels.log" 2>&1; then
        log "pip could not install the wheels (see $out/wheels.log)"
        exit 2
    fi
    export PYTHONPATH="$site:$PYTHONPATH"
fi

# What kiln and the GPU tests import: a Python without it is one line, not a traceback.
if ! missing="$("$python" - 2>&1 <<'PY'
import importlib, sys
for name in ("torch", "numpy", "tokenizers", "safetensors", "matplotlib", "pytest"):
    try:
        importlib.import_module(name)
    except Exception as error:
        sys.exit(f"{name}: {type(error).__name__}: {error}")
PY
)"; then
    log "$python cannot run kiln (${missing##*$'\n'}): point PYTHON at a Python with kiln's" \
        "requirements and pytest (PYTHON=/path/to/python scripts/gpu_check.sh OUTDIR; the" \
        "checkout's .venv from \`make install\` is used when it exists), or carry wheels with --wheels DIR" >&2
    exit 2
fi

# The environment: Python, torch >= 2.11, CUDA, versions; written as JSON for the report.
if ! timeout 120 "$python" - "$out/environment.json" >"$out/environment.log" 2>&1 <<'PY'; then
import datetime, json, platform, shutil, subprocess, sys
import torch

def version(name):
    try:
        module = __import__(name)
        return getattr(module, "__version__", "?")
    except ModuleNotFoundError as error:
        if error.name == name:
            return "not installed"
        return f"not importable ({error})"
    except Exception as error:  # an import that fails is a finding, not a crash
        return f"not importable ({type(error).__name__}: {error})"

major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
env = {
    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    "python": platform.python_version(),
    "torch": torch.__version__,
    "torch_ok": (major, minor) >= (2, 11),
    "cuda_runtime": torch.version.cuda,
    "cuda_available": cuda,
    "torchao": version("torchao"),
    "torchtitan": version("torchtitan"),
    "host": platform.node(),
}
if cuda:
    props = torch.cuda.get_device_properties(0)
    env |= {
        "device": props.name,
        "device_count": torch.cuda.device_count(),
        "memory_gib": round(props.total_memory / 2**30, 1),
        "capability": f"{props.major}.{props.minor}",
    }
else:
    env["device"] = "no CUDA device"
if shutil.which("nvidia-smi"):
    query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    done = subprocess.run(query, capture_output=True, text=True)
    env["driver"] = done.stdout.strip().splitlines()[0] if done.returncode == 0 else None
json.dump(env, open(sys.argv[1], "w"), indent=1)
print(json.dumps(env, indent=1))
if not env["torch_ok"]:
    sys.exit(f"torch {torch.__version__} is older than 2.11, which kiln needs")
PY
    log "the environment check failed:"
    cat "$out/environment.log" >&2
    exit 2
fi
cat "$out/environment.log"
gpu="$("$python" -c 'import json,sys; print(int(json.load(open(sys.argv[1]))["cuda_available"]))' \
    "$out/environment.json")"

# The GPU test suite, by path: it may not exist in this checkout yet.
tests_state="not run"
if [[ "$gpu" != 1 ]]; then
    tests_state="skipped: no CUDA device"
    log "no CUDA device: the GPU tests are skipped"
elif [[ ! -d tests/gpu ]]; then
    tests_state="skipped: tests/gpu is not in this checkout"
    log "$tests_state"
else
    log "GPU tests (limit ${tests_limit} s)"
    timeout --kill-after=10 "$tests_limit" "$python" -m pytest -m gpu tests/gpu -q -rfEs \
        -p no:cacheprovider --junitxml "$out/gpu_tests.xml" >"$out/gpu_tests.log" 2>&1
    code=$?
    tail -n 15 "$out/gpu_tests.log"
    case $code in
    0) tests_state="passed" ;;
    1) tests_state="failed" status=1 ;;
    5) tests_state="no test collected" ;;
    124 | 137) tests_state="timed out after ${tests_limit} s" status=1 ;;
    *) tests_state="pytest exit $code" status=1 ;;
    esac
fi

# The benchmark: kiln against a hand-written loop and torchtitan (docs/gpu_check.md).
bench_state="not run"
bench_args=()
if [[ "$gpu" == 1 ]]; then
    bench_args=(--device cuda)
elif ((cpu_dry_run)); then
    bench_args=(--device cpu)
fi
if ((${#bench_args[@]})); then
    read -r -a extra <<<"${KILN_CHECK_BENCH_ARGS:-}"
    bench_args+=("${extra[@]}")
    # Stop starting runs in time to write the tables before the part's limit.
    budget=$((bench_limit - 20))
    log "benchmark ${bench_args[*]} (limit ${bench_limit} s)"
    timeout --kill-after=10 "$bench_limit" "$python" benchmarks/gpu_side_by_side.py \
        "${bench_args[@]}" --out "$out" --budget-s "$budget" --run-timeout-s "$budget" \
        >"$out/benchmark.log" 2>&1
    code=$?
    tail -n 25 "$out/benchmark.log"
    case $code in
    0) bench_state="ran" ;;
    124 | 137) bench_state="timed out after ${bench_limit} s" status=1 ;;
    *) bench_state="exit $code" status=1 ;;
    esac
else
    bench_state="skipped: no CUDA device (--cpu-dry-run runs its CPU dry run)"
fi

# report.md and results.json from what the parts left in OUTDIR.
elapsed=$((SECONDS - started))
if ! "$python" - "$out" "$tests_state" "$bench_state" "$elapsed" "$cpu_dry_run" <<'PY'; then
import json, sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, tests_state, bench_state, elapsed = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
cpu_dry_run = sys.argv[5] == "1"
env = json.loads((out / "environment.json").read_text())

def cases(path):
    """Each test case of a JUnit file: name, outcome, seconds, reason (failures, skips)."""
    if not path.exists():
        return []
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, reason = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome = {"failure": "failed"}.get(kind, kind)
                text = found.get("message") or (found.text or "")
                reason = " ".join(text.split())[:300]
                break
        name = f"{case.get('classname', '')}::{case.get('name')}".removeprefix("tests.gpu.")
        rows.append({"test": name, "outcome": outcome, "seconds": float(case.get("time") or 0),
                     "reason": reason})
    return rows

tests = cases(out / "gpu_tests.xml")
bench_md = out / "side_by_side.md"
bench = json.loads((out / "side_by_side.json").read_text()) if (out / "side_by_side.json").exists() else None
counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
gpu = env["cuda_available"]
slug = "-".join(env["device"].lower().replace("nvidia", "").split())
folder = f"benchmarks/gpu/{env['date'][:10]}-{slug}/" if gpu else None  # a dry run is not kept
cell = lambda text: str(text).replace("|", "\\|")
# Only a GPU's report is a measurement to keep; a run without one checks the script.
if gpu:
    title, keep = env["device"], f"- commit it under: {folder}"
elif cpu_dry_run:
    title = "CPU dry run (no CUDA device), not a GPU measurement"
    keep = ("- **a CPU dry run**: it checks this script and the benchmark's code on kiln's debug "
            "model, not a machine; its numbers are no GPU's. Do not commit it under benchmarks/gpu/")
else:
    title = "no CUDA device, nothing measured"
    keep = "- no CUDA device: no test or benchmark ran; nothing here to commit"
lines = [
    f"# kiln GPU check: {title}",
    "",
    f"- date: {env['date']}; host {env['host']}; {elapsed} s in all",
    f"- device: {env['device']}" + (f", {env['memory_gib']} GiB, compute capability {env['capability']}, "
                                    f"{env['device_count']} visible" if env["cuda_available"] else ""),
    f"- driver: {env.get('driver') or 'unknown (no nvidia-smi)'}",
    f"- Python {env['python']}, torch {env['torch']} (CUDA {env['cuda_runtime']}), "
    f"torchao {env['torchao']}, torchtitan {env['torchtitan']}",
    keep,
    "",
    f"## GPU tests: {tests_state}",
    "",
]
if tests:
    lines += [", ".join(f"{n} {k}" for k, n in counts.items()), "",
              "| test | outcome | s | reason |", "|---|---|---:|---|"]
    lines += [f"| {cell(t['test'])} | {t['outcome']} | {t['seconds']:.1f} | {cell(t['reason'])} |"
              for t in tests]
else:
    lines.append("No test results (see the line above).")
lines += ["", f"## Benchmark (benchmarks/gpu_side_by_side.py): {bench_state}", ""]
lines.append(bench_md.read_text() if bench_md.exists() else "No benchmark table.")
(out / "report.md").write_text("\n".join(lines) + "\n")
results = {"environment": env, "elapsed_s": int(elapsed), "commit_folder": folder,
           "cpu_dry_run": cpu_dry_run and not gpu,
           "tests": {"state": tests_state, "counts": counts, "cases": tests},
           "benchmark": {"state": bench_state, "results": bench}}
(out / "results.json").write_text(json.dumps(results, indent=1))
PY
    log "could not write the report"
    exit 1
fi
log "report: $out/report.md (${elapsed} s; tests: $tests_state; benchmark: $bench_state)"
exit "$status"
