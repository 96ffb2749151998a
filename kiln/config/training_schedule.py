"""The shape of every optimizer step as a function of the tokens seen before it: how many
micro-batches each data rank accumulates (`[train.batch_schedule]`, the batch ramp) and the
micro-batch's rows and sequence length (`[[train.seq_len_schedule]]`, the phases).

Pure integer arithmetic on the config (no torch), so the loader, the learning-rate schedule,
validation and `kiln check` agree on every step, and a resume (at any layout with the same
`multiple_of`) finds the same shapes from the data position alone. "Tokens" are the positions
a step reads (sequences × sequence length), padding and masked labels included."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.config.sections import TrainConfig


@dataclass(frozen=True)
class StepShape:
    """One step: `micro_batches` passes on every data rank, each of `batch_size` sequences of
    `seq_len` tokens."""

    micro_batches: int
    batch_size: int
    seq_len: int

    def sequences(self, data_ranks: int) -> int:
        """The step's global batch in sequences."""
        return self.micro_batches * self.batch_size * data_ranks

    def tokens(self, data_ranks: int) -> int:
        """The positions the whole step reads, over all data ranks."""
        return self.sequences(data_ranks) * self.seq_len


@dataclass(frozen=True)
class Phase:
    """Consecutive steps of one shape, for `kiln check`: steps `first`..`last` (1-based), which
    read tokens [`tokens_from`, `tokens_to`)."""

    first: int
    last: int
    tokens_from: int
    tokens_to: int
    shape: StepShape


class TrainingSchedule:
    """Every step's shape for a job of `data_ranks` data-parallel ranks (validated config)."""

    def __init__(self, train: TrainConfig, *, data_ranks: int):
        self.train, self.data_ranks = train, data_ranks
        self.row = train.batch_size * data_ranks  # sequences of one micro-batch on every rank
        self.full_batch = self.row * train.grad_accum_steps
        self.multiple_of = train.batch_schedule.multiple_of or self.row
        self.ramped = bool(train.batch_schedule.tokens)

    @property
    def full_step_tokens(self) -> int:
        """Tokens of a step at the recipe's batch and sequence length: the unit of the
        learning-rate schedule under `scheduler.unit = "tokens"`."""
        return self.full_batch * self.train.seq_len

    def batch_at(self, tokens: int) -> int:
        """The global batch (in sequences of the recipe's micro-batch) the ramp sets after
        `tokens` tokens seen."""
        ramp = self.train.batch_schedule
        if not self.ramped or tokens >= ramp.tokens[-1]:
            return self.full_batch
        i = max(k for k, t in enumerate(ramp.tokens) if t <= tokens)
        low, high = ramp.sequences[i], ramp.sequences[i + 1]
        if ramp.shape == "step" or high == low:
            return low
        span, into = ramp.tokens[i + 1] - ramp.tokens[i], tokens - ramp.tokens[i]
        # low + (high - low) · into / span, rounded down to `multiple_of`, in integers: exact on
        # every machine.
        steps_up = (low * span + (high - low) * into) // (span * self.multiple_of)
        return max(low, steps_up * self.multiple_of)

    def shape_at(self, tokens: int) -> StepShape:
        """The shape of the step that starts after `tokens` tokens seen."""
        micro_batches = self.batch_at(tokens) // self.row
        for phase in self.train.seq_len_schedule:
            if tokens < phase.until_tokens:
                return StepShape(micro_batches, phase_batch_size(self.train, phase), phase.seq_len)
        return StepShape(micro_batches, self.train.batch_size, self.train.seq_len)

    def next_change(self, tokens: int) -> int | None:
        """The fewest tokens seen, more than `tokens`, at which the shape may change (None:
        never): the next ramp point, the ramp's next rounding step, or the phase's end."""
        ramp, out = self.train.batch_schedule, []
        out += [phase.until_tokens for phase in self.train.seq_len_schedule]
        if self.ramped:
            out += list(ramp.tokens)
            i = max((k for k, t in enumerate(ramp.tokens) if t <= tokens), default=None)
            if ramp.shape == "linear" and i is not None and i + 1 < len(ramp.tokens):
                low, high = ramp.sequences[i], ramp.sequences[i + 1]
                span, up = ramp.tokens[i + 1] - ramp.tokens[i], self.batch_at(tokens)
                if high > low:  # where low + (high - low) · into / span reaches the next multiple
                    need = (up + self.multiple_of) * span - low * span
                    out.append(ramp.tokens[i] - (-need // (high - low)))
        later = [t for t in out if t > tokens]
        return min(later) if later else None

    def phases(self, steps: int) -> list[Phase]:
        """Steps 1..`steps` grouped by shape, in order: one jump per change of shape, however
        long the run."""
        out: list[Phase] = []
        step, tokens = 1, 0
        while step <= steps:
            shape = self.shape_at(tokens)
            per_step = shape.tokens(self.data_ranks)
            change = self.next_change(tokens)
            count = steps - step + 1
            if change is not None:
                count = min(count, -(-(change - tokens) // per_step))
            end = tokens + count * per_step
            if out and out[-1].shape == shape:
                out[-1] = Phase(out[-1].first, step + count - 1, out[-1].tokens_from, end, shape)
            else:
                out.append(Phase(step, step + count - 1, tokens, end, shape))
            step, tokens = step + count, end
        return out

    def total_tokens(self, steps: int) -> int:
        """The tokens `steps` steps read."""
        return self.phases(steps)[-1].tokens_to if steps > 0 else 0

    def describe(self, steps: int) -> list[str]:
        """`kiln check`'s lines: each phase's steps, tokens, batch and sequence length."""
        if not self.ramped and not self.train.seq_len_schedule:
            return []
        lines = []
        for phase in self.phases(steps):
            shape = phase.shape
            steps = (
                f"step {phase.first}"
                if phase.first == phase.last
                else f"steps {phase.first}-{phase.last}"
            )
            sequences = _count(shape.sequences(self.data_ranks), "sequence")
            micro = _count(shape.micro_batches, "micro-batch", "micro-batches")
            lines.append(
                f"{steps}: global batch {sequences} of {shape.seq_len} tokens ({micro} of "
                f"{shape.batch_size} per data rank), tokens {phase.tokens_from:,} to "
                f"{phase.tokens_to:,}"
            )
        return lines


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n:,} {one if n == 1 else many or one + 's'}"


def phase_batch_size(train: TrainConfig, phase) -> int:
    """A sequence-length phase's sequences per micro-batch: its own, or the recipe's micro-batch
    tokens at its length (validated to divide)."""
    return phase.batch_size or train.batch_size * train.seq_len // phase.seq_len
