"""lm-evaluation-harness tasks: names checked before any model is loaded, run through the
harness's own evaluation loop, scores flattened to `eval/<task>/<metric>`."""

from __future__ import annotations

import difflib
import importlib.util
import numbers
import os
import random
import socket
import sys
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kiln.errors import ConfigError, KilnError, first_line
from kiln.log import warn

# The harness's default seed for few-shot examples, numpy and torch (lm_eval.defaults.
# DEFAULT_OTHER_SEED): the same prompts as `lm-eval run` builds.
FEWSHOT_SEED = 1234


def require_harness(what: str) -> None:
    # Looked up, not imported: `kiln check` validates without paying for the import.
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(
            f"{what} needs lm-evaluation-harness, which is not installed: pip install 'kiln[eval]'"
        )


def task_manager(names: list[str], *, include_path: str = "") -> Any:
    """A harness TaskManager that knows every task of `names` (registered names of tasks,
    groups or tags, or task YAML files), with the tasks of `include_path` (a folder of task
    YAMLs) added. Indexing the harness's own thousands of tasks takes seconds, so a folder that
    holds every task asked for is indexed alone. An unknown name is one ConfigError, and so,
    offline (see `use_cache_when_offline`), is a task whose datasets the cache lacks."""
    offline = use_cache_when_offline()  # before the harness imports the datasets library
    manager = _manager(names, include_path)
    if offline:
        # Offline, a dataset missing from the cache is found now, before a model is loaded.
        load_tasks(manager, names)
    return manager


def _manager(names: list[str], include_path: str) -> Any:
    from lm_eval.tasks import TaskManager

    if include_path:
        if not Path(include_path).is_dir():
            raise ConfigError(f"eval task folder {include_path} is not a directory")
        local = TaskManager(include_path=include_path, include_defaults=False)
        if not _unknown(names, local):
            return local
    manager = TaskManager(include_path=include_path or None)
    unknown = _unknown(names, manager)
    if unknown:
        hints = [f"{name!r}{_did_you_mean(name, manager.all_tasks)}" for name in unknown]
        raise ConfigError(
            f"lm-evaluation-harness knows no task, group or tag named {', '.join(hints)}: list "
            "them with `lm-eval ls tasks`, or pass a folder of your own task YAMLs "
            "(kiln eval --include-path, eval.tasks_path)"
        )
    return manager


# Seconds to wait for the Hub to answer before reading the cache alone.
HUB_PROBE_S = 3.0
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def use_cache_when_offline() -> bool:
    """Whether the tasks' datasets come from the local cache alone: set so by the user, or
    because the Hub does not answer now. Without a Hub the datasets library retries every file
    for tens of seconds before it fails, so an unreachable Hub switches this process offline."""
    if any(
        os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE") for name in OFFLINE_VARIABLES
    ):
        return True
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    if hub_reachable(endpoint):
        return False
    warn(
        f"the Hugging Face Hub ({endpoint}) cannot be reached: the tasks' datasets are "
        "read from the local cache only"
    )
    go_offline()
    return True


def hub_reachable(endpoint: str, timeout: float = HUB_PROBE_S) -> bool:
    """Whether a TCP connection to the endpoint opens within `timeout` seconds. In a thread:
    a name lookup without network can hang longer than any socket timeout."""
    url = urlsplit(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    reached = []

    def connect() -> None:
        try:
            socket.create_connection((url.hostname or "", port), timeout=timeout).close()
            reached.append(True)
        except OSError:
            pass

    probe = threading.Thread(target=connect, daemon=True)
    probe.start()
    probe.join(timeout)
    return bool(reached)


def go_offline() -> None:
    """Offline mode for this process: the variables for what imports the libraries later, and
    the flags they read them into at import for what already has."""
    for name in OFFLINE_VARIABLES:
        os.environ[name] = "1"
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].constants.HF_HUB_OFFLINE = True
    if "datasets" in sys.modules:
        config = sys.modules["datasets"].config
        config.HF_HUB_OFFLINE = config.HF_DATASETS_OFFLINE = True


def load_tasks(manager: Any, names: list[str]) -> dict[str, Any]:
    """Fresh task objects for `names`, their datasets loaded; a dataset the Hub cannot give
    (offline, not in the cache) is one KilnError that says how to get it."""
    try:
        return manager.load(names)
    except ConnectionError as error:
        cache = os.environ.get("HF_HOME", "~/.cache/huggingface")
        download = f"from lm_eval.tasks import TaskManager; TaskManager().load({names!r})"
        raise KilnError(
            f"lm-evaluation-harness cannot load the datasets of {', '.join(names)}: "
            f"{first_line(error)}. Without network they must be in the local Hugging Face "
            f"cache ({cache}): on a machine with network download them with "
            f'`python -c "{download}"`, copy that cache here (or point HF_HOME at it), and '
            "set HF_DATASETS_OFFLINE=1"
        ) from None


def _unknown(names: list[str], manager: Any) -> list[str]:
    known = set(manager.all_tasks)
    return [name for name in names if name not in known and not Path(name).is_file()]


def _did_you_mean(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def run_tasks(
    lm: Any,
    manager: Any,
    names: list[str],
    *,
    limit: int | None = None,
    num_fewshot: int | None = None,
    bootstrap_iters: int = 0,
    log_samples: bool = False,
) -> dict[str, Any]:
    """The harness's results for `names` scored by `lm`: what `lm_eval.simple_evaluate` does
    with the same arguments (few-shot counts, few-shot seed), without its report on the host
    (which runs `pip list` and `git` every time). `bootstrap_iters` 0: no standard errors."""
    import numpy as np
    import torch
    from lm_eval.evaluator import evaluate

    # The seeds simple_evaluate sets: a task that draws on the global generators draws the same.
    random.seed(0)
    np.random.seed(FEWSHOT_SEED)
    torch.manual_seed(FEWSHOT_SEED)
    loaded = load_tasks(manager, names)  # fresh task objects: a task keeps the requests it built
    for task in loaded["tasks"].values():
        default = task.get_config("num_fewshot")
        # A task whose config fixes 0 shots keeps it, as in the harness.
        if num_fewshot is not None and default != 0:
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif default is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=FEWSHOT_SEED)
    return evaluate(
        lm=lm,
        task_dict=loaded,
        limit=limit,
        bootstrap_iters=bootstrap_iters,
        log_samples=log_samples,
    )


def task_scores(results: dict[str, Any]) -> dict[str, float]:
    """`eval/<task>/<metric>` for every number the harness reports (a filter other than
    "none" is appended, `eval/gsm8k/exact_match/strict-match`); standard errors left out."""
    scores = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            metric, _, filter_name = key.partition(",")
            if not filter_name or metric.endswith("_stderr"):
                continue
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                suffix = "" if filter_name == "none" else f"/{filter_name}"
                scores[f"eval/{task}/{metric}{suffix}"] = float(value)
    return scores
