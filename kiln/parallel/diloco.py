"""DiLoCo and Streaming DiLoCo across replica groups (`[fault_tolerance] sync = "diloco"`):
each group trains on its own for H inner steps; then the groups average their pseudo-gradients
(the last synchronized weights minus their own) and every group applies one outer step, SGD with
Nesterov momentum, to the synchronized weights (Douillard et al. 2023). With F fragments
(Streaming DiLoCo, 2025) the model's blocks are split into F contiguous fragments, one of which
synchronizes every H / F steps, its all-reduce started `fragment_sync_delay` steps before the
outer step that needs it.

This module is the algorithm on one rank's shards: which fragment a parameter belongs to, when
a fragment prepares and performs its sync, and the outer optimizer's state. Forming the quorum,
the all-reduce and the commit are the replica groups' (kiln/parallel/replica_groups.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

from kiln.config.sections import FaultToleranceConfig, JobConfig
from kiln.model.parallel_plan import ParallelPlan, blocks_of
from kiln.model.registry import family_of

if TYPE_CHECKING:
    from kiln.parallel.replica_groups import ReplicaGroups


class SyncPhase(StrEnum):
    PREPARE = "prepare"  # form the quorum, take the pseudo-gradient, start its all-reduce
    PERFORM = "perform"  # wait for it, commit, apply the outer step


@dataclass(frozen=True)
class Schedule:
    """When each fragment syncs: every `sync_every` / `fragments` inner steps one fragment, in
    turn; its all-reduce starts `delay` steps before its outer step."""

    sync_every: int
    fragments: int = 1
    delay: int = 0

    def __post_init__(self) -> None:
        assert self.sync_every % self.fragments == 0, "validated in the config"
        assert 0 <= self.delay < self.sync_every // self.fragments, "validated in the config"

    @property
    def interval(self) -> int:
        """Inner steps between two syncs (of successive fragments)."""
        return self.sync_every // self.fragments

    def phases(self, step: int) -> list[SyncPhase]:
        """What happens after the inner update of step `step` (1-based), in order."""
        offset = step % self.interval
        out = []
        if offset == 0:
            out.append(SyncPhase.PERFORM)
        if offset == (self.interval - self.delay) % self.interval:
            out.append(SyncPhase.PREPARE)
        # With no delay a fragment prepares and performs after the same step, in that order.
        return sorted(out, key=lambda p: p is SyncPhase.PERFORM)

    def fragment(self, syncs: int) -> int:
        """The fragment of the sync after `syncs` committed ones (a failed sync is retried)."""
        return syncs % self.fragments


def fragment_of(
    names: list[str], *, block_of: dict[str, int], blocks: int, fragments: int
) -> dict[str, int]:
    """Each parameter's fragment: blocks (`block_of`: a parameter's block index, from the
    model's plan) in `fragments` contiguous runs, the first ones a block longer when they do not
    divide; a parameter of no block before the first block's in `names` (the order of the
    model's parameters: the embedding) in fragment 0, one after (final norm, head) in the last."""
    assert 1 <= fragments <= blocks, "validated in the config"
    base, extra = divmod(blocks, fragments)
    first_block, start = [], 0
    for index in range(fragments):
        first_block.append(start)
        start += base + (index < extra)
    out, seen_block = {}, False
    for name in names:
        if name not in block_of:
            out[name] = fragments - 1 if seen_block else 0
            continue
        seen_block = True
        block = min(block_of[name], blocks - 1)  # extra blocks (multi-token prediction): last
        out[name] = max(i for i, first in enumerate(first_block) if first <= block)
    return out


class OuterOptimizer:
    """The synchronized weights of this rank's shards and their Nesterov momentum: what every
    group holds alike, and what a checkpoint and a rejoining group need."""

    def __init__(self, weights: dict[str, torch.Tensor], *, lr: float, momentum: float):
        self.lr, self.momentum = lr, momentum
        self.synced = {name: w.detach().clone() for name, w in weights.items()}
        # Zeros, not torch's lazily cloned first buffer: μ·0 + Δ is exactly Δ, so the result is
        # bitwise torch.optim.SGD(nesterov=True)'s and the state has a fixed shape to save.
        self.buffers = {name: torch.zeros_like(w) for name, w in self.synced.items()}

    def pseudo_gradients(
        self, weights: dict[str, torch.Tensor], names: list[str]
    ) -> list[torch.Tensor]:
        """Synchronized minus local, for the parameters `names`: what the groups average."""
        return [self.synced[name] - weights[name].detach() for name in names]

    def step(self, names: list[str], averaged: list[torch.Tensor]) -> None:
        """One outer step of the parameters `names` from the groups' mean pseudo-gradients."""
        for name, delta in zip(names, averaged, strict=True):
            buffer = self.buffers[name]
            buffer.mul_(self.momentum).add_(delta)
            self.synced[name].add_(delta.add(buffer, alpha=self.momentum), alpha=-self.lr)

    def assign(self, weights: dict[str, torch.Tensor], names: list[str]) -> None:
        """The local weights of `names` become the synchronized ones."""
        with torch.no_grad():
            for name in names:
                weights[name].copy_(self.synced[name])

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        return {"synced": self.synced, "buffers": self.buffers}

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        for kind in ("synced", "buffers"):
            own = getattr(self, kind)
            for name, value in state[kind].items():
                own[name].copy_(value)


class DiLoCoSync:
    """This rank's part in DiLoCo's syncs across the replica groups: after each inner step, the
    schedule's phases. A group that healed in a sync's quorum (its weights a live group's)
    weighs 0 in that sync's mean, or the live group's update would count twice."""

    def __init__(
        self,
        cfg: FaultToleranceConfig,
        replicas: ReplicaGroups,
        model_parts: list[torch.nn.Module],
        *,
        plan: ParallelPlan,
        blocks: int,
    ):
        self.schedule = Schedule(cfg.sync_every, cfg.fragments, cfg.fragment_sync_delay)
        self.replicas, self.settings = replicas, cfg
        self.params = {n: p for part in model_parts for n, p in part.named_parameters()}
        block_of = {
            f"{block.path}.{name}": block.layer
            for part in model_parts
            for block in blocks_of(part, plan)
            for name, _ in block.module.named_parameters()
        }
        self.fragment = fragment_of(
            list(self.params), block_of=block_of, blocks=blocks, fragments=cfg.fragments
        )
        self.syncs = 0
        self.in_flight: tuple[list[str], torch.Tensor, Any] | None = None
        self.reset()
        replicas.share_state("diloco", self.load_state_dict, self.state_dict)

    def reset(self) -> None:
        """The synchronized weights are the current ones (a start, a resume, a heal)."""
        self.outer = OuterOptimizer(
            self.local(), lr=self.settings.outer_lr, momentum=self.settings.outer_momentum
        )

    def local(self) -> dict[str, torch.Tensor]:
        """This rank's shards of the weights, sharing their storage."""
        return {n: _local(p.detach()) for n, p in self.params.items()}

    def after_step(self, step: int) -> bool | None:
        """The schedule's phases after the inner update of step `step`; whether a sync
        performed here committed (None: none performed)."""
        committed = None
        for phase in self.schedule.phases(step):
            if phase is SyncPhase.PREPARE:
                self._prepare(step)
            else:
                committed = self._perform(step)
        return committed

    def _prepare(self, step: int) -> None:
        # A group behind heals here: the trainer loads a live group's weights, optimizer, data
        # position and this state (`load_state_dict`) before the pseudo-gradient is taken.
        quorum = self.replicas.sync_quorum(step)
        fragment = self.schedule.fragment(self.syncs)
        names = [n for n in self.params if self.fragment[n] == fragment]
        deltas = self.outer.pseudo_gradients(self.local(), names)
        weight = 0.0 if quorum.healed else 1.0
        flat = torch.cat([d.reshape(-1) * weight for d in deltas] + [_scalar(weight, deltas)])
        self.in_flight = names, flat, self.replicas.start_sum(flat)

    def _perform(self, step: int) -> bool:
        names, flat, work = self.in_flight
        self.in_flight = None
        work.wait()
        committed = self.replicas.commit(step)
        if committed:
            mean = flat[:-1] / flat[-1]
            sizes = [self.outer.synced[n].numel() for n in names]
            averaged = [
                part.view_as(self.outer.synced[n])
                for n, part in zip(names, mean.split(sizes), strict=True)
            ]
            self.outer.step(names, averaged)
            self.syncs += 1
        # A sync that did not commit leaves the fragment at its last synchronized weights: its
        # inner steps since are dropped in every group alike.
        self.outer.assign(self.local(), names)
        return committed

    def resume_tensors(self, train_state: dict[str, Any] | None) -> dict[str, torch.Tensor] | None:
        """What a resume loads the outer state into, when the checkpoint holds it (not a warm
        start, nor a checkpoint of another sync mode: their synchronized weights are the ones
        loaded)."""
        return self.checkpoint_tensors() if "diloco_syncs" in (train_state or {}) else None

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The outer state as a checkpoint holds it: each tensor sharded as its parameter (a
        DTensor over this rank's local shard), so a resume in another layout reshards it.
        Loading into these loads into the outer state (they share its storage)."""
        out = {}
        for kind, tensors in self.outer.state_dict().items():
            for name, local in tensors.items():
                out[f"{kind}.{name}"] = _like(self.params[name], local)
        return out

    def state_dict(self) -> dict[str, Any]:
        """What a rejoining group needs besides the weights (cloned: the sender trains on)."""
        state = {
            k: {n: t.clone() for n, t in v.items()} for k, v in self.outer.state_dict().items()
        }
        return state | {"syncs": self.syncs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.outer.load_state_dict(state)
        self.syncs = state["syncs"]

    def train_state(self) -> dict[str, int]:
        """What a checkpoint's train state says of DiLoCo: the syncs committed (the next
        fragment; its presence tells a resume that the outer state is in the checkpoint)."""
        return {"diloco_syncs": self.syncs}

    def restored(self, train_state: dict[str, Any] | None) -> None:
        """After a resume that loaded the outer state (`train_state`: the checkpoint's), its
        syncs; after any other start (None), the synchronized weights are the current ones."""
        if train_state is None:
            self.reset()
        else:
            self.syncs = train_state["diloco_syncs"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as a tensor sharded like `param` (the same storage)."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(),
        run_check=False,
    )  # fmt: skip


def _scalar(value: float, like: list[torch.Tensor]) -> torch.Tensor:
    reference = like[0] if like else torch.zeros(())
    return torch.full((1,), value, dtype=reference.dtype, device=reference.device)


def diloco_sync(
    cfg: JobConfig, replicas: ReplicaGroups | None, model_parts: list[torch.nn.Module]
) -> DiLoCoSync | None:
    """This rank's DiLoCo under `[fault_tolerance] sync = "diloco"`; None otherwise."""
    ft = cfg.fault_tolerance
    if not ft.enabled or ft.sync != "diloco":
        return None
    plan = family_of(cfg.model).parallel_plan(cfg.model)
    return DiLoCoSync(ft, replicas, model_parts, plan=plan, blocks=cfg.model.n_layers)
