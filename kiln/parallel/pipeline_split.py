"""Which layers form each pipeline stage, and which stages each pipeline rank runs.

Pure arithmetic on the config (no torch). The schedule names, `num_stages` and `microbatches`
live in `kiln/config/pipeline.py`, which validation uses; they are imported here for the rest.
"""

from __future__ import annotations

from kiln.config.pipeline import microbatches, num_stages
from kiln.config.sections import DistributedConfig, JobConfig


def layers_per_stage(dist: DistributedConfig, n_layers: int) -> list[int]:
    """Transformer layers in each stage, first to last: the explicit list, or balanced so that
    each stage's layers plus its share of embedding and output head are as equal as possible."""
    if dist.pp_layers_per_stage:
        return list(dist.pp_layers_per_stage)
    stages = num_stages(dist)
    extra = [0] * stages  # the embedding and output head, counted in layers
    extra[0] += dist.pp_embedding_layers
    extra[-1] += dist.pp_output_layers
    counts = [1] * stages
    for _ in range(n_layers - stages):
        # Water-filling: the next layer goes to the lightest stage (the earliest on a tie).
        lightest = min(range(stages), key=lambda s: (counts[s] + extra[s], s))
        counts[lightest] += 1
    return counts


def stage_layers(dist: DistributedConfig, n_layers: int, stage: int) -> range:
    """Indices of the transformer layers in `stage`."""
    counts = layers_per_stage(dist, n_layers)
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


def stages_of_rank(dist: DistributedConfig, pp_rank: int) -> list[int]:
    """Stage indices pipeline rank `pp_rank` runs: stage s goes to rank s mod pp (a loop), except
    for zbv, whose V shape gives rank r stages r and 2·pp − 1 − r, so that the first and last
    stages share rank 0 and the turn of the V needs no communication."""
    if dist.pp_schedule == "zbv":
        return [pp_rank, 2 * dist.pp - 1 - pp_rank]
    return [pp_rank + v * dist.pp for v in range(dist.pp_virtual_stages)]


def stage_rank(dist: DistributedConfig, stage: int) -> int:
    """The pipeline rank that runs `stage`."""
    return next(r for r in range(dist.pp) if stage in stages_of_rank(dist, r))


def bubble_fraction(dist: DistributedConfig, n_microbatches: int) -> float:
    """Idle share of a pipeline pass, idealized (forward, input-backward and weight-backward of a
    stage take equal time, communication is free): the formulas in docs/pipeline.md."""
    p, m, v = dist.pp, n_microbatches, dist.pp_virtual_stages
    if p == 1:
        return 0.0
    if dist.pp_schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if dist.pp_schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    if dist.pp_schedule == "interleaved_zero_bubble":
        # Weight gradients (a third of the work) fill two thirds of the 1F1B warm-up and cool-down.
        return (p - 1) / (3 * v * m + p - 1)
    if m >= 2 * p - 1:
        return 0.0  # zbv: the V fills the bubble completely
    return (p - 1) / (3 * 2 * m + p - 1)  # too few micro-batches: as interleaved zero bubble, v=2


def in_flight_microbatches(dist: DistributedConfig, n_microbatches: int) -> float:
    """Micro-batches whose activations the first rank holds at its peak, in units of one
    micro-batch through all of that rank's layers (all its virtual stages together)."""
    p, m, v = dist.pp, n_microbatches, dist.pp_virtual_stages
    if p == 1 or dist.pp_schedule == "gpipe":
        return m
    if dist.pp_schedule in ("1f1b", "zbv"):
        return min(p, m)
    return min(p, m) * (1 + (p - 1) / (p * v))  # interleaved: the deeper warm-up


def pipeline_summary(cfg: JobConfig) -> str:
    """One line for `kiln check`: schedule, stages, split, micro-batches and the ideal bubble."""
    d = cfg.distributed
    m = microbatches(d, cfg.train.batch_size)
    return (
        f"schedule {d.pp_schedule}, {num_stages(d)} stages ({d.pp} ranks × {d.pp_virtual_stages}), "
        f"layers per stage {layers_per_stage(d, cfg.model.n_layers)}, {m} micro-batches × "
        f"{cfg.train.batch_size // m} sequence(s) per pass, ideal bubble {bubble_fraction(d, m):.0%}"
    )
