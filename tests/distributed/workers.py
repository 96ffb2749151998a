"""Gangs: N worker processes started once per test session that run many jobs in turn.

A parity job trains ten small steps; starting torchrun and N Python processes that each import
torch costs more than that on two cores. A gang starts its N processes once (one thread each,
forked from a fork server that imported torch and kiln once for all gangs) and then runs jobs
in sequence. A job is a module-level function called on every rank with the same arguments;
`kiln_train` is `kiln train` itself: the same `kiln.cli.main`, so the config is built and the
Trainer run exactly as on the command line, and the process group is set up from env:// (on a
store the gang starts for each job, as torchrun's agent does) and torn down at the clean end of
the job, as `kiln train` does under torchrun. Environment variables and a mutation
(tests/support/mutations.py, by name) are set for one job only, and every job gets its own
output file per rank. A job's CPU collectives go through the test suite's shared-memory arena
(tests/support/accelerator.py: on 2 cores, gloo's TCP loopback takes much of a step), or, for
a job run with `shared_memory=False`, through stock gloo, as kiln's own CPU runs do.

A job that fails on any rank (an exception, a non-zero exit, a dead process) or runs past its
time limit is reported with every rank's traceback and output. When every rank answered (each
one's call returned or raised, none died or hung), each has left the job's process group and the
gang runs the next job; otherwise it is killed, since a rank left waiting in a collective must not
hang the next job, and the next job starts a fresh gang."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import signal
import socket
import sys
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path

from torch.distributed import TCPStore

from tests.support import accelerator, mutations

JOB_TIMEOUT_S = 300
# A worker with more threads than this is replaced before its next job: a safety net, since
# each job's gloo groups are freed at its end (`_leave_process_group`); a whole run with
# hundreds of leftover threads per worker took several times as long.
MAX_THREADS = 120
# After one rank fails, the others get this long to report their own error before the kill.
GRACE_S = 10
# Handlers a job may install (the Trainer's preemption flag): put back after every job.
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


# What every worker needs, imported once by the fork server that forks the workers: a gang
# starts in a fraction of a second, and its first job does not import 1,100 modules on every
# rank at once (torch and kiln.cli alone take 3 s a process on two cores).
PRELOAD = [
    "torch",
    "kiln.cli",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "torch.distributed.elastic.multiprocessing",
    "torch.distributed.fsdp",
    "torch.distributed.nn",
    "torch.distributed.pipelining",
    "torch.distributed.tensor.parallel",
]
# The fork server starts with the first gang; the preload list applies from then on.
FORKS = multiprocessing.get_context("forkserver")
FORKS.set_forkserver_preload(PRELOAD)

NO_ANSWER = "no answer in time (hung, or waiting for a rank that failed)"
DIED = "the process died"


def rank_answered(error: str) -> bool:
    """The rank's call ended with this error (it did not die or hang)."""
    return error != NO_ANSWER and not error.startswith(DIED)


class JobFailed(AssertionError):
    def __init__(self, errors: dict[int, str], outputs: list[str]):
        self.errors, self.outputs = errors, outputs
        parts = [f"--- rank {rank}: {error}" for rank, error in sorted(errors.items())]
        parts += [f"--- rank {rank} output:\n{out[-3000:]}" for rank, out in enumerate(outputs)]
        super().__init__("job failed\n" + "\n".join(parts))


class Gang:
    def __init__(self, world_size: int, log_dir: Path):
        self.world_size, self.log_dir, self.jobs = world_size, log_dir, 0
        log_dir.mkdir(parents=True, exist_ok=True)
        self.conns, self.procs = [], []
        for rank in range(world_size):
            parent, child = FORKS.Pipe()
            proc = FORKS.Process(
                target=serve,
                args=(rank, world_size, child, str(log_dir / f"rank_{rank}.txt")),
                name=f"gang{world_size}-rank{rank}",
                daemon=False,  # a daemon may not start the data loader's worker process
            )
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def threads(self) -> int:
        """Threads of the first rank's process (gloo keeps 3 per process group it has seen)."""
        status = Path(f"/proc/{self.procs[0].pid}/status")
        lines = status.read_text().splitlines() if status.exists() else []
        return next((int(line.split()[1]) for line in lines if line.startswith("Threads:")), 0)

    @property
    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    def run(
        self,
        function,
        *args,
        env: dict | None = None,
        mutation: str | None = None,
        shared_memory: bool = True,
        timeout: float = JOB_TIMEOUT_S,
    ):
        """Call `function(*args)` on every rank, with `mutation` installed (None: none) and
        kiln's CPU collectives in shared memory (`shared_memory`) or on gloo; return each rank's
        output (stdout and stderr)."""
        self.jobs += 1
        logs = [self.log_dir / f"job_{self.jobs}_rank_{r}.txt" for r in range(self.world_size)]
        # The job's store is up before any rank starts, hosted here as torchrun's agent hosts
        # it: hosted by rank 0, it made the other ranks retry their connection with back-off
        # (0.3-0.6 s of each job's start-up, benchmarks/test_suite.md).
        store = TCPStore("127.0.0.1", 0, self.world_size, is_master=True, wait_for_workers=False)
        agent = {"MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
        job = (function, args, {**(env or {}), **agent}, mutation, shared_memory)
        for conn, log in zip(self.conns, logs, strict=True):
            conn.send((*job, str(log)))
        started = time.monotonic()
        errors = self._collect(timeout)
        del store
        with (self.log_dir / "jobs.tsv").open("a") as times:  # benchmarks/test_suite.md
            times.write(f"{self.jobs}\t{time.monotonic() - started:.2f}\t{args!r}\n")
        outputs = [log.read_text() if log.exists() else "" for log in logs]
        if errors:
            if not (self.alive and all(rank_answered(e) for e in errors.values())):
                self.close()
            raise JobFailed(errors, outputs)
        return outputs

    def _collect(self, timeout: float) -> dict[int, str]:
        """Every rank's answer: None when its call returned, else its error."""
        pending = {conn: rank for rank, conn in enumerate(self.conns)}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for conn in wait(list(pending), left):
                rank = pending.pop(conn)
                try:
                    error = conn.recv()
                except (EOFError, OSError):
                    self.procs[rank].join(5)
                    error = f"{DIED} (exit code {self.procs[rank].exitcode})"
                if error is not None and not errors:
                    deadline = min(deadline, time.monotonic() + GRACE_S)
                if error is not None:
                    errors[rank] = error
        for rank in pending.values():
            errors[rank] = NO_ANSWER
        return errors

    def close(self) -> None:
        """Tell every rank to stop; kill the ones that cannot hear it (stuck in a collective)."""
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        deadline = time.monotonic() + 2
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join()


class Gangs:
    """One gang per world size, started on first use and again after a failed job."""

    def __init__(self, log_dir: Path):
        self.log_dir, self.gangs, self.started = log_dir, {}, 0

    def run(
        self,
        world_size: int,
        function,
        *args,
        env: dict | None = None,
        mutation: str | None = None,
        shared_memory: bool = True,
    ) -> list[str]:
        gang = self.gangs.get(world_size)
        if gang is not None and gang.alive and gang.threads() > MAX_THREADS:
            gang.close()  # leftover gloo threads slow every job: start afresh
        if gang is None or not gang.alive:
            self.started += 1
            gang = Gang(world_size, self.log_dir / f"gang_{self.started}_of_{world_size}")
            self.gangs[world_size] = gang
        return gang.run(function, *args, env=env, mutation=mutation, shared_memory=shared_memory)

    def close(self) -> None:
        for gang in self.gangs.values():
            gang.close()


def kiln_train(args: list[str]) -> None:
    """`kiln train ARGS` on this rank, as the command line runs it."""
    import torch.distributed as dist

    from kiln.cli import main

    code = main(["train", *args])
    group = "; its process group is up" if dist.is_initialized() else ""
    if code != 0:
        raise RuntimeError(f"kiln train exited with code {code}{group} (see its output)")
    assert not group, "kiln train ended cleanly but left its process group behind"


def serve(rank: int, world_size: int, conn, log: str) -> None:
    """A worker's life: set up the rank once, then run jobs until told to stop (None)."""
    _redirect_output(log)
    os.environ["OMP_NUM_THREADS"] = "1"  # for the processes a job starts (data loader workers)
    if world_size > 1:  # one process runs as plain `kiln train`, without these
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
        )
    import torch

    import kiln.cli  # noqa: F401  (imported once, not in the first job)

    # Ranks get a core each; a one-process job (the parity references) has every core to itself.
    torch.set_num_threads(1 if world_size > 1 else os.cpu_count() or 1)
    # What the imports created is never garbage: frozen, the collection after each job walks
    # only what the jobs left (0.35 s per process and job otherwise).
    gc.freeze()
    with contextlib.suppress(EOFError):  # the test session ended without saying goodbye
        while (job := conn.recv()) is not None:
            conn.send(_run(*job))


def _run(
    function, args: tuple, env: dict, mutation: str | None, shared_memory: bool, log: str
) -> str | None:
    saved_env = dict(os.environ)
    saved_handlers = {sig: signal.getsignal(sig) for sig in SIGNALS}
    os.environ.update(env)
    try:
        with _output_to(log), mutations.installed(mutation), accelerator.installed(shared_memory):
            function(*args)
    except BaseException:  # SystemExit too: argparse exits on a bad argument
        return traceback.format_exc()
    finally:
        _leave_process_group()
        os.environ.clear()
        os.environ.update(saved_env)
        for sig, handler in saved_handlers.items():
            signal.signal(sig, handler)
        _forget_compiled_code()
    return None


def _leave_process_group() -> None:
    """A job that failed half-way leaves its process group up; the next job sets up its own.
    Then the job's groups are freed. Each gloo group keeps three threads until its last
    reference goes, and DTensor's sharding caches (C++ and Python) hold the job's meshes, so
    without this every mesh shape's last groups stay alive, and idle, their threads still take
    CPU: 15% of a core for one 4-rank gang after six layouts, every gang alive taking its share
    of every later test (benchmarks/test_suite.md)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if "torch.distributed.tensor" in sys.modules:
        clear_dtensor_caches()
    gc.collect()


def clear_dtensor_caches() -> None:
    import torch
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute

    torch._C._clear_DTensor_sharding_propagator_cache()
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()


def _forget_compiled_code() -> None:
    """torch.compile caches code per process; a later job must compile its own model afresh
    rather than hit the recompile limit and quietly run eagerly."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()


@contextlib.contextmanager
def _output_to(path: str):
    """Send this process's stdout and stderr (Python's and C++'s) to `path` for a while."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    _redirect_output(path)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def _redirect_output(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
