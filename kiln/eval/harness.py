"""lm-evaluation-harness's model interface over a kiln model: log-likelihoods (batched, longest
first, left-truncated to the context), rolling log-likelihoods (perplexity tasks: windows over
the text) and greedy generation until a stop sequence.

Text is encoded with the checkpoint's `tokenizer.json`, no special tokens added. A request
without context is conditioned on the end-of-document token: kiln's token streams put one before
every document, so it is what the model has seen at the start of a text. The adapter is
registered with the harness as "kiln" (`model_args="checkpoint=RUN_DIR"`)."""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tokenizers import Tokenizer
from tqdm import tqdm

from kiln.data.tokenizer import eos_id
from kiln.errors import KilnError
from kiln.eval.runner import ModelRunner, load_whole_model

# The harness's default for generation tasks that set no max_gen_toks.
MAX_GEN_TOKS = 256
Request = tuple[tuple[str, str] | None, list[int], list[int]]


class KilnLM(TemplateLM):
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        *,
        batch_size: int = 8,
        progress: bool = False,
    ):
        """`batch_size`: rows per forward when scoring. `progress`: show progress bars (one
        rank of a lockstep group)."""
        super().__init__()
        self.runner, self.tokenizer, self.batch_size = runner, tokenizer, batch_size
        self.progress = progress
        self._eos = eos_id(tokenizer)

    @property
    def eot_token_id(self) -> int:
        return self._eos

    @property
    def max_length(self) -> int:
        return self.runner.max_length

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs
    ) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=False).ids

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _loglikelihood_tokens(
        self, requests: list[Request], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        """(log-probability, greedy) of each continuation after its context. The longest rows
        go first and together, so a batch holds rows of similar length and pads little."""
        rows = [
            (context + continuation)[-(self.max_length + 1) :]
            for _, context, continuation in requests
        ]
        lengths = [len(continuation) for _, _, continuation in requests]
        if max(lengths, default=0) > self.max_length:
            raise KilnError(
                f"a continuation of {max(lengths)} tokens is longer than the context of "
                f"{self.max_length} tokens the model is scored with (kiln eval --seq-len, "
                "train.seq_len): the harness cannot score it"
            )
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        bar = tqdm(total=len(rows), desc="loglikelihood", disable=disable_tqdm or not self.progress)
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            scores = self.runner.score([rows[i] for i in batch], [lengths[i] for i in batch])
            for i, score in zip(batch, scores, strict=True):
                results[i] = score
                if requests[i][0] is not None:  # rolling windows are cached per text below
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], score)
            bar.update(len(batch))
        bar.close()
        return results

    def loglikelihood_rolling(
        self, requests: list[Instance], disable_tqdm: bool = False
    ) -> list[float]:
        """Log-probability of each whole text, in windows of the model's context: every token
        predicted once, each window with as much preceding text as fits."""
        windows: list[Request] = []
        owners: list[int] = []
        for index, request in enumerate(requests):
            (text,) = request.args
            pairs = get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, continuation in map(make_disjoint_window, pairs):
                windows.append((None, context, continuation))
                owners.append(index)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for owner, (log_prob, _) in zip(owners, scores, strict=True):
            totals[owner] += log_prob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation of each context until one of its stop sequences (cut off), the
        end-of-document token or max_gen_toks new tokens; one request at a time."""
        out = []
        for request in tqdm(requests, desc="generate", disable=disable_tqdm or not self.progress):
            context, gen_kwargs = request.args
            kwargs = normalize_gen_kwargs(gen_kwargs, MAX_GEN_TOKS)
            if kwargs["do_sample"]:
                raise KilnError(
                    f"task {request.task_name} samples its generations (do_sample); kiln's "
                    "harness adapter generates greedily: pick a greedy task or variant"
                )
            until = handle_stop_sequences(kwargs.get("until"), eos=None)
            max_new = kwargs["max_gen_toks"]
            if max_new >= self.max_length:
                raise KilnError(
                    f"task {request.task_name} generates up to {max_new} tokens, which leaves no "
                    f"room for its prompt in the context of {self.max_length} tokens the model "
                    "is scored with (kiln eval --seq-len, train.seq_len)"
                )
            # Left-truncated so that the prompt and the new tokens fit the context.
            prompt = self.tok_encode(context)[-(self.max_length - max_new) :] or [self._eos]
            stop = partial(self._stops, until)
            new = self.runner.greedy(prompt, max_new_tokens=max_new, stop=stop)
            text = postprocess_generated_text(
                self.tok_decode(new), stop=until, think_end_token=None
            )
            self.cache_hook.add_partial("generate_until", request.args, text)
            out.append(text)
        return out

    def _stops(self, until: Iterable[str], new: list[int]) -> bool:
        if new[-1] == self._eos:
            return True
        text = self.tok_decode(new)
        return any(stop and stop in text for stop in until)


@register_model("kiln")
class KilnCheckpointLM(KilnLM):
    """A kiln checkpoint whole on one process, by name: after `import kiln.eval.harness`,
    `lm_eval.simple_evaluate(model="kiln", model_args="checkpoint=runs/x/checkpoints")`."""

    def __init__(
        self,
        checkpoint: str,
        batch_size: int | str | None = 8,
        device: str | None = None,
        max_batch_size: int | None = None,
    ):
        """`max_batch_size`: passed by the harness, unused (batches have a fixed size)."""
        runner, tokenizer = load_whole_model(checkpoint, device=device or "auto")
        super().__init__(runner, tokenizer, batch_size=int(batch_size or 8), progress=True)
