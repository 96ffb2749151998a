"""The forward passes the harness adapter asks of a kiln model: log-likelihoods of token rows and
greedy continuations. The model is whole on this process (`kiln eval CKPT --tasks` on one
process), or parallelized over every rank (FSDP, tensor, expert parallel; not pipeline or context
parallel), which then all run the same requests in lockstep, as during training."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import nn
from torch.distributed.tensor import DTensor

from kiln.checkpoint import find_tokenizer, load_checkpoint, read_model_config, resolve_checkpoint
from kiln.config import JobConfig
from kiln.data.tokenizer import load_tokenizer
from kiln.errors import KilnError
from kiln.model import build_model, materialize
from kiln.model.generate import generate
from kiln.parallel.agree import any_rank
from kiln.parallel.device import pick_device
from kiln.parallel.mesh import ParallelContext
from kiln.parallel.mixed_precision import training_autocast


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        *,
        max_length: int,
        autocast: contextlib.AbstractContextManager | None = None,
        lockstep: bool = False,
        pad_multiple: int = 1,
        kv_cache: bool = True,
    ):
        """`model`: a kiln Transformer (possibly wrapped by FSDP, tensor or expert parallel).
        `lockstep`: every rank runs the same calls (a parallelized model); each generation step's
        stop is then agreed by all ranks. `pad_multiple`: rows are padded to a multiple of it (the
        tp degree: sequence parallel splits the sequence). `kv_cache`: generate with a KV cache
        (the whole model on one process); otherwise each new token re-runs the sequence."""
        self.model, self.max_length = model, max_length
        self.autocast = autocast if autocast is not None else contextlib.nullcontext()
        self.lockstep, self.pad_multiple, self.kv_cache = lockstep, pad_multiple, kv_cache

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def score(self, rows: list[list[int]], continuations: list[int]) -> list[tuple[float, bool]]:
        """For each row of tokens (at most max_length + 1), the summed log-probability of its
        last `continuations[i]` tokens given the tokens before them, and whether greedy decoding
        would have produced exactly those tokens. One batched forward for all rows."""
        logits = self._logits([row[:-1] for row in rows])
        results = []
        for row, n, row_logits in zip(rows, continuations, logits, strict=True):
            end = len(row) - 1  # the inputs' length: logits at i predict row[i + 1]
            log_probs = torch.log_softmax(row_logits[end - n : end].float(), dim=-1)
            targets = torch.tensor(row[-n:], device=log_probs.device)
            picked = log_probs.gather(-1, targets[:, None]).sum().item()
            results.append((picked, bool((log_probs.argmax(-1) == targets).all())))
        return results

    @torch.no_grad()
    def greedy(
        self, prompt: list[int], *, max_new_tokens: int, stop: Callable[[list[int]], bool]
    ) -> list[int]:
        """Greedy continuation of `prompt` until `stop(new tokens)`, `max_new_tokens` or the
        model's context is full."""
        if self.lockstep:
            stop = self._agreed(stop)
        if self.kv_cache:
            with self.autocast:
                return generate(self.model, prompt, max_new_tokens=max_new_tokens, stop=stop)
        new: list[int] = []
        while len(new) < max_new_tokens and len(prompt) + len(new) <= self.max_length:
            new.append(int(self._logits([prompt + new])[0, len(prompt) + len(new) - 1].argmax()))
            if stop(new):
                break
        return new

    def _agreed(self, stop: Callable[[list[int]], bool]) -> Callable[[list[int]], bool]:
        """`stop` as every rank decides it: one that ran on would wait in a collective forever."""
        return lambda new: any_rank({"stop": stop(new)}, device=self.device)["stop"]

    def _logits(self, rows: list[list[int]]) -> torch.Tensor:
        """Logits (batch, longest row, vocab) of right-padded rows: attention is causal, so the
        padding after a row changes nothing at the row's own positions."""
        length = math.ceil(max(map(len, rows)) / self.pad_multiple) * self.pad_multiple
        tokens = torch.zeros((len(rows), length), dtype=torch.long)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row)
        with self.autocast:
            logits = self.model(tokens.to(self.device))
        # Tensor parallel leaves the logits split over the vocabulary (loss parallel).
        return logits.full_tensor() if isinstance(logits, DTensor) else logits


def load_whole_model(
    checkpoint: str | Path, *, device: str = "auto"
) -> tuple[ModelRunner, Tokenizer]:
    """A checkpoint of any layout whole on this process (bf16 autocast on a GPU, as `kiln
    generate` runs it), and the tokenizer beside it."""
    path = resolve_checkpoint(checkpoint)
    tokenizer_path = find_tokenizer(path)
    if tokenizer_path is None:
        raise KilnError(
            f"no tokenizer.json in {path} or its parent: copy the tokenizer the model was "
            "trained with there"
        )
    on = pick_device(device)
    cfg = read_model_config(path)
    model = materialize(build_model(cfg), device=on, seed=None)
    load_checkpoint(path, model=model)
    autocast = torch.autocast(on.type, dtype=torch.bfloat16, enabled=on.type == "cuda")
    runner = ModelRunner(model, max_length=cfg.max_seq_len, autocast=autocast)
    return runner, load_tokenizer(tokenizer_path)


def parallel_runner(model: nn.Module, cfg: JobConfig, parallel: ParallelContext) -> ModelRunner:
    """The runner over a model built and parallelized as `cfg` says (no pipeline or context
    parallel), computing as the trainer does (its autocast, FP8), every rank in lockstep. Rows
    are padded to a multiple of the tp degree (sequence parallel splits them) and under FP8 of
    16 tokens (float8 matmuls need it); the KV cache serves a model whole on one process,
    neither compiled nor in float8."""
    fp8 = cfg.train.mixed_precision == "fp8"
    return ModelRunner(
        model,
        max_length=cfg.train.seq_len,
        autocast=training_autocast(cfg, parallel),
        lockstep=parallel.world_size > 1,
        pad_multiple=parallel.degrees["tp"] * (16 if fp8 else 1),
        kv_cache=parallel.world_size == 1 and not (fp8 or cfg.train.compile),
    )
