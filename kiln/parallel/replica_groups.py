"""Replica groups with torchft (docs/fault_tolerance.md). Each dp_replicate slice is a torchrun
job of its own; before every step a quorum over the lighthouse decides which groups train it.
Inside a step the groups sum what plain HSDP sums over dp_replicate (the valid token count, the
gradients, the loss) over the groups in the quorum, each FSDP unit's gradients during the
backward as HSDP does; a group that rejoins receives the weights, optimizer state and data
position from a live peer in the quorum that admits it, and a step that lost a peer midway
commits nowhere and is not counted."""

from __future__ import annotations

import logging
import os
import socket
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch
from torch.distributed import ReduceOp
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from kiln.config.sections import FaultToleranceConfig, JobConfig
from kiln.errors import ConfigError, KilnError, first_line
from kiln.events import EventLog
from kiln.log import info, warn
from kiln.parallel.agree import decide_on_main
from kiln.parallel.mesh import ParallelContext

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
# The key of the sending group's number in what a live group sends a rejoining one.
SENDER = "replica_group"
# Gradient shards are summed across groups in buckets of this size: one collective per bucket,
# and never a second copy of all of a rank's gradients at once.
BUCKET_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Quorum:
    """The groups training this step: how many, and this group's place among them."""

    participants: int
    replica_rank: int
    healed: bool  # this group received its state from a peer before the step


class ReplicaGroups:
    """This process's part in the torchft quorum of its replica group."""

    def __init__(
        self,
        cfg: FaultToleranceConfig,
        parallel: ParallelContext,
        *,
        state_fn: Callable[[], dict[str, Any]],
        load_fn: Callable[[dict[str, Any]], None],
        events: EventLog,
        group_batch: int,
    ):
        """`group_batch`: the sequences one group trains per step (its share of the global
        batch)."""
        self.cfg, self.group, self.events = cfg, parallel.replica_group, events
        self.parallel, self.state_fn, self.load_fn = parallel, state_fn, load_fn
        self.group_batch = group_batch
        self.lighthouse = lighthouse_address(cfg)
        decide_on_main(
            lambda: check_reachable(self.lighthouse, timeout_s=cfg.connect_timeout_s),
            what="reach the fault-tolerance lighthouse",
        )
        self.manager, self.pg = None, None
        self._healed = False
        self.failed_in_a_row, self.last = 0, None
        # The groups of the last quorum, and the last step that did not commit (and why): what
        # rank 0 says when the groups change.
        self.members: tuple[int, ...] = ()
        self.not_committed: tuple[int, str] | None = None
        # Where this group's state came from when it healed: (peer group, the peer's step).
        self.healed_from: tuple[int, int] | None = None
        # A quorum is formed before each step and used by its commit.
        self.in_quorum = False
        self.shared: dict[str, tuple[Callable, Callable]] = {}

    def connect(self) -> None:
        """Join the lighthouse: from here on the group heartbeats and counts in quorums, so
        this comes last in start-up (a group that is slow to start holds no one back)."""
        # torchft logs every quorum and commit (its Rust side at INFO): kiln reports what
        # changes (events.jsonl, warnings). RUST_LOG set by the user wins.
        os.environ.setdefault("RUST_LOG", "warn")
        logging.getLogger("torchft").setLevel(logging.ERROR)
        # torchft reads a peer's tensors from a read-only buffer and copies them at once.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
        from torchft.checkpointing.http_transport import HTTPTransport

        cfg, parallel = self.cfg, self.parallel

        def load(state: dict[str, Any]) -> None:
            self.load_fn(state)
            self._healed = True
            self.healed_from = state[SENDER], self.manager.current_step()

        def send() -> dict[str, Any]:
            return self.state_fn() | {SENDER: self.group}

        timeout = timedelta(seconds=cfg.timeout_s)
        pg_type = ProcessGroupNCCL if parallel.device.type == "cuda" else ProcessGroupGloo
        self.pg = _naming_groups(pg_type)(timeout=timeout)
        self.manager = Manager(
            pg=self.pg,
            load_state_dict=load,
            state_dict=send,
            min_replica_size=cfg.min_replicas,
            # The quorum is awaited before the forward: a rejoining group loads its peer's
            # state first and trains the step with the others (no step of zeroed gradients).
            use_async_quorum=False,
            # Every group draws the same initial weights from train.seed.
            init_sync=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
            connect_timeout=timedelta(seconds=cfg.connect_timeout_s),
            # A peer's state is sent whole: its own bound, which the sender also waits on
            # before its next update.
            checkpoint_transport=HTTPTransport(
                timeout=timedelta(seconds=cfg.recovery_timeout_s), num_chunks=0
            ),
            rank=parallel.rank,
            world_size=parallel.world_size,
            lighthouse_addr=self.lighthouse,
            # torchft numbers the groups by the digits that end the id.
            replica_id=f"kiln_{self.group}",
            **_group_store(parallel.world_size),
        )
        for key, (load_fn, state_fn) in self.shared.items():
            self.manager.register_state_dict_fn(key, load_fn, state_fn)

    def share_state(self, key: str, load_fn: Callable, state_fn: Callable) -> None:
        """More state a live group sends a rejoining one under `key` (DiLoCo's), loaded after
        the trainer's (whose check refuses another run's first)."""
        self.shared[key] = load_fn, state_fn

    def start_step(self, step: int) -> Quorum:
        """The quorum of step `step` (1-based); a group behind the others loads a peer's
        state in it. Raises KilnError when no quorum forms within its timeout, and when the
        group's first quorum fails (its state could not be received: it would only hold the
        live groups back)."""
        first = self.manager is None
        if first:
            self.connect()
        self._healed = False
        try:
            self.manager.start_quorum()
        except TimeoutError as error:
            raise KilnError(
                f"replica group {self.group}: no quorum for step {step} within "
                f"{self.cfg.quorum_timeout_s:g} s (fault_tolerance.quorum_timeout_s): "
                f"{first_line(error)}. Is the lighthouse at {self.lighthouse} still running? "
                "Restart it and this group (it rejoins from a live peer, or every group "
                "resumes from the last checkpoint)"
            ) from None
        if first and self.manager.errored() is not None:
            raise KilnError(
                f"replica group {self.group} could not join the run: "
                f"{first_line(self.manager.errored().original_exception)}. The live groups "
                "train on; restart this group to try again"
            )
        quorum = Quorum(
            participants=self.manager.num_participants(),
            replica_rank=self.manager.participating_rank(),
            healed=self._healed,
        )
        if quorum.healed or self.last is None or quorum.participants != self.last.participants:
            self.events.write(
                "quorum",
                step=self.manager.current_step() + 1,  # a group that healed is at its peer's
                replica_group=self.group,
                participants=quorum.participants,
                replica_rank=quorum.replica_rank,
                healed=quorum.healed,
            )
        if self.parallel.is_main:
            self._say_who_trains(step, quorum)
        self.members = self.pg.groups
        self.last, self.in_quorum = quorum, True
        return quorum

    def _say_who_trains(self, step: int, quorum: Quorum) -> None:
        """One line when the groups that train change: which group left or joined (this one
        from whom), and the global batch the step trains now."""
        left = sorted(set(self.members) - set(self.pg.groups))
        joined = sorted(set(self.pg.groups) - set(self.members))
        if quorum.healed:
            peer, peer_step = self.healed_from
            what = (
                f"replica group {self.group} joined at step {peer_step + 1} from group {peer} "
                "(its weights, optimizer state and data position; no checkpoint read)"
            )
        elif self.last is None or not (left or joined):
            return  # this group's start: the start-up summary says where it starts from
        else:
            changes = [f"group {g} left" for g in left] + [f"group {g} joined" for g in joined]
            what = f"replica group {self.group}: {', '.join(changes)} at step {step}"
            if left and self.not_committed is not None and self.not_committed[0] == step:
                # The error is long, and torchft logs it above: events.jsonl keeps it.
                what += f" (step {step} did not commit and is trained again; events.jsonl says why)"
        groups = self.parallel.replica_groups
        batch = self.group_batch * quorum.participants
        line = (
            f"{what}; {'this group trains on' if left else 'training'} with "
            f"{quorum.participants} of {groups} groups: global batch {batch} sequences"
        )
        out = sorted(set(range(groups)) - set(self.pg.groups))
        if out:
            names = (
                f"group {out[0]} rejoins"
                if len(out) == 1
                else f"groups {', '.join(map(str, out))} rejoin"
            )
            line += f" ({self.group_batch * groups} with every group) until {names}"
        (warn if left else info)(line)

    def peer_start(self) -> str | None:
        """Where this group started from when a live group sent it its state (for the start-up
        summary); None when it did not."""
        if self.healed_from is None:
            return None
        peer, step = self.healed_from
        return f"replica group {peer}'s state at step {step} (no checkpoint read)"

    def sum(self, tensors: list[torch.Tensor]) -> None:
        """Sum `tensors` in place over the groups of this step's quorum, in one collective. A
        failure is not raised: it leaves the values undefined and the step uncommitted."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        offset = 0
        for tensor in tensors:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()

    def sync_quorum(self, step: int) -> Quorum:
        """DiLoCo: the quorum of a sync after step `step` (the groups' only rendezvous); the
        Manager's step is the trainer's, so a group behind the others heals in it."""
        if self.manager is None:
            self.connect()
        self.set_step(step)
        return self.start_step(step)

    def start_sum(self, flat: torch.Tensor) -> Any:
        """DiLoCo: start summing `flat` in place over the quorum's groups; wait on the result.
        A failure leaves the values undefined and the sync uncommitted."""
        return self.manager.allreduce(flat, reduce_op=ReduceOp.SUM)

    def sum_in_backward(self, model_parts: list[torch.nn.Module]) -> bool:
        """Sum each FSDP unit's gradient shard over the groups as soon as the unit's
        reduce-scatter has made it (FSDP2's all-reduce hook), as HSDP's all-reduce over
        dp_replicate runs: the sum overlaps the backward of the units still to run, and it comes
        before FSDP's division, as HSDP's does. Returns whether the hook serves this layout;
        where it does not (no FSDP inside a group, expert parallel: docs/fault_tolerance.md),
        `sum_gradients` sums every shard after the backward."""
        units = [m for part in model_parts for m in part.modules() if isinstance(m, FSDPModule)]
        if not units or self.parallel.degrees["ep"] > 1:
            return False
        covered = {id(p) for unit in units for p in unit.parameters()}
        if any(id(p) not in covered for part in model_parts for p in part.parameters()):
            return False

        def sum_shard(reduced: torch.Tensor) -> None:
            # On a GPU the wait orders the stream FSDP runs this on, not the host. A failure
            # leaves the values undefined and the step uncommitted, as in `sum`.
            self.manager.allreduce(reduced, reduce_op=ReduceOp.SUM).wait()

        for unit in units:
            unit.set_all_reduce_hook(sum_shard)
        return True

    def sum_gradients(self, params: list[torch.nn.Parameter], extra: list[torch.Tensor]) -> None:
        """Sum every gradient shard of this rank (and the `extra` values) over the groups, in
        buckets of one dtype and at most BUCKET_BYTES: the ranks of one place in each group
        hold the same shards."""
        for param in params:
            if param.grad is None:  # unused this step here, perhaps not in another group
                param.grad = torch.zeros_like(param)
        local = [_local(p.grad) for p in params] + extra
        for dtype in sorted({t.dtype for t in local}, key=str):
            bucket, size = [], 0
            for tensor in (t for t in local if t.dtype == dtype):
                bucket.append(tensor)
                size += tensor.numel() * tensor.element_size()
                if size >= BUCKET_BYTES:
                    self.sum(bucket)
                    bucket, size = [], 0
            if bucket:
                self.sum(bucket)

    def commit(self, step: int) -> bool:
        """Whether every rank of every group in the quorum finished the step: the update is
        applied only then. A group gives up after fault_tolerance.max_failed_steps in a row."""
        committed, self.in_quorum = self.manager.should_commit(), False
        if committed:
            self.failed_in_a_row = 0
            return True
        self.failed_in_a_row += 1
        reason = self.manager.errored()
        if reason is not None:
            why = first_line(reason.original_exception)
        elif self.last.participants < self.cfg.min_replicas:
            why = f"too few groups ({self.last.participants} < fault_tolerance.min_replicas)"
        else:
            why = "another rank of the quorum failed in the step"
        self.events.write("not_committed", step=step, replica_group=self.group, reason=why)
        self.not_committed = step, why
        if self.failed_in_a_row >= self.cfg.max_failed_steps:
            raise KilnError(
                f"replica group {self.group} gives up: {self.failed_in_a_row} steps in a row "
                f"could not commit (fault_tolerance.max_failed_steps); the last because {why}"
            )
        return False

    def set_step(self, step: int) -> None:
        """The step the run is at (after a resume): the quorum brings groups behind it up."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def writes_checkpoints(self) -> bool:
        """The first group of the last quorum saves the run's checkpoints (one writer); under
        DiLoCo every group saves its own (their inner states differ)."""
        return self.cfg.sync == "diloco" or self.last is None or self.last.replica_rank == 0

    def close(self) -> None:
        if self.manager is not None:  # under DiLoCo a run may end before its first sync
            self.manager.shutdown(wait=False)


def join_replica_groups(
    cfg: JobConfig,
    parallel: ParallelContext,
    state_fn: Callable[[], dict[str, Any]],
    load_fn: Callable[[dict[str, Any]], None],
    *,
    events: EventLog,
) -> ReplicaGroups | None:
    """This process's replica group under fault tolerance (`state_fn` gives what a rejoining
    group receives, `load_fn` loads it); None without fault tolerance."""
    if not cfg.fault_tolerance.enabled:
        return None
    ft = cfg.fault_tolerance
    group_batch = cfg.train.batch_size * cfg.train.grad_accum_steps * parallel.group_data_ranks
    return ReplicaGroups(
        ft, parallel, state_fn=state_fn, load_fn=load_fn, events=events, group_batch=group_batch
    )


def group_run_config(cfg: JobConfig) -> JobConfig:
    """Under fault tolerance each replica group logs to <run_dir>/replica_group_<g> (metrics,
    events, config), and the run's checkpoints stay in <run_dir>/checkpoints."""
    if not cfg.fault_tolerance.enabled:
        return cfg
    run_dir = Path(cfg.metrics.run_dir)
    group = f"replica_group_{cfg.fault_tolerance.replica_group}"
    group_dir = run_dir / group
    checkpoint_dir = cfg.checkpoint.dir or str(run_dir / "checkpoints")
    if cfg.fault_tolerance.sync == "diloco":  # each group's own: their inner states differ
        checkpoint_dir = f"{checkpoint_dir.rstrip('/')}/{group}"
    return replace(
        cfg,
        metrics=replace(cfg.metrics, run_dir=str(group_dir)),
        checkpoint=replace(cfg.checkpoint, dir=checkpoint_dir),
    )


def lighthouse_address(cfg: FaultToleranceConfig) -> str:
    """fault_tolerance.lighthouse, else $TORCHFT_LIGHTHOUSE."""
    address = cfg.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
    if not address:
        raise ConfigError(
            "fault_tolerance.enabled needs a lighthouse: set fault_tolerance.lighthouse (or "
            f"${LIGHTHOUSE_ENV}) to the address of a running `torchft_lighthouse`, e.g. "
            "http://node0:29510 (docs/fault_tolerance.md, 'Launching')"
        )
    return address


def check_reachable(address: str, *, timeout_s: float) -> None:
    """Connect once to the lighthouse, for a clear message instead of torchft's retries."""
    parts = urlsplit(address if "://" in address else f"http://{address}")
    try:
        with socket.create_connection((parts.hostname, parts.port or 29510), timeout=timeout_s):
            pass
    except OSError as error:
        raise KilnError(
            f"no lighthouse answers at {address} ({error}): start it first, e.g. "
            "`torchft_lighthouse --min_replicas 1 --bind [::]:29510`, and point "
            "fault_tolerance.lighthouse (or $TORCHFT_LIGHTHOUSE) at it"
        ) from None


def _group_store(world_size: int) -> dict[str, Any]:
    """torchft's managers meet in the group's TCPStore: the process group's (MASTER_ADDR/PORT,
    which the other groups must reach too), or for a group of one process, which builds no
    process group, a store of its own."""
    if world_size > 1:
        return {}
    host = socket.gethostname()
    store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    _STORES.append(store)  # kept alive for the process's lifetime
    return {"store_addr": host, "store_port": store.port}


_STORES: list[torch.distributed.TCPStore] = []


def _naming_groups(pg_type: type) -> type:
    """torchft's process group `pg_type`, keeping which replica groups the current quorum's
    spans (`groups`): torchft hands it the quorum's ranks (group × group size + rank) and does
    not say otherwise who is in a quorum."""

    class NamingGroups(pg_type):
        groups: tuple[int, ...] = ()

        def configure(
            self,
            store_addr: str,
            replica_id: str,
            rank: int,
            world_size: int,
            quorum_id: int | None = None,
            group_rank: int | None = None,
            group_world_size: int | None = None,
            global_ranks: list[int] | None = None,
        ) -> None:
            if global_ranks and group_world_size:
                self.groups = tuple(sorted({r // group_world_size for r in global_ranks}))
            super().configure(
                store_addr,
                replica_id,
                rank,
                world_size,
                quorum_id,
                group_rank,
                group_world_size,
                global_ranks,
            )

    return NamingGroups


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
