"""[eval] tasks during training: lm-evaluation-harness scores the training model itself every
eval.tasks_interval steps, logged as eval/<task>/<metric>.

Every rank feeds the same requests through its part of the parallelized model (FSDP, tensor and
expert parallel; validation refuses pipeline and context parallel), so each forward's
collectives match on all ranks, and each rank computes the same scores. The random generators
are put back afterwards: a run with tasks trains exactly as one without."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from kiln.config import JobConfig
from kiln.data.loader import Source
from kiln.data.sources import training_tokenizer
from kiln.data.tokenizer import load_tokenizer
from kiln.errors import ConfigError
from kiln.parallel.mesh import ParallelContext


class TaskEval:
    def __init__(
        self,
        cfg: JobConfig,
        parallel: ParallelContext,
        model_parts: list[nn.Module],
        *,
        sources: list[Source],
    ):
        e = cfg.eval
        self.interval, self.held_out_interval = e.effective_tasks_interval, e.interval
        self.names, self.limit = e.tasks, e.tasks_limit or None
        self.num_fewshot = None if e.tasks_num_fewshot == -1 else e.tasks_num_fewshot
        self.device = parallel.device
        if not self.interval:
            return
        # lm-evaluation-harness is an optional extra: imported only by a run that uses it.
        from kiln.eval.harness import KilnLM
        from kiln.eval.runner import parallel_runner
        from kiln.eval.tasks import task_manager

        tokenizer = training_tokenizer(cfg.data, sources)
        if tokenizer is None:
            raise ConfigError(
                "eval.tasks encodes the harness's text with the training tokenizer, which this "
                "data source does not name: set data.tokenizer"
            )
        self.manager = task_manager(self.names, include_path=e.tasks_path)
        (model,) = model_parts  # one part: no pipeline stages (validated)
        runner = parallel_runner(model, cfg, parallel)
        self.lm = KilnLM(runner, load_tokenizer(tokenizer), batch_size=cfg.train.batch_size)

    def due(self, step: int) -> bool:
        return bool(self.interval) and step % self.interval == 0

    def at(
        self,
        step: int,
        *,
        held_out: Callable[[Any], dict[str, float]],
        data: Any,
    ) -> dict[str, float]:
        """What the trainer evaluates at `step`: the held-out loss, `held_out(data)`, unless
        only the tasks are due; then the tasks' scores when they are due."""
        held_out_due = bool(self.held_out_interval) and step % self.held_out_interval == 0
        scores = held_out(data) if held_out_due or not self.due(step) else {}
        if self.due(step):
            scores |= self.scores()
        return scores

    def scores(self) -> dict[str, float]:
        from kiln.eval.tasks import run_tasks, task_scores

        with preserved_rng(self.device):
            results = run_tasks(
                self.lm, self.manager, self.names, limit=self.limit, num_fewshot=self.num_fewshot
            )
        return task_scores(results)


@contextlib.contextmanager
def preserved_rng(device: torch.device) -> Iterator[None]:
    """Python's, numpy's and torch's generators (this device's too) as they were before."""
    python, numpy = random.getstate(), np.random.get_state()
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy)
