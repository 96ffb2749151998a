"""A run's claim on the checkpoint location it writes to: an `OWNER` file (object) naming the run,
renewed by a heartbeat while the run lives.

Two jobs writing one `checkpoint.dir` (a requeued job overlapping its predecessor, two users
with the same setting) would delete each other's saves in flight and interleave `latest`. So a
run that saves takes the lease before writing anything, on rank 0: a lease whose heartbeat is
older than `EXPIRES_S` belonged to a run that died without releasing it and is taken over; a
live one held by another run is waited for (`checkpoint.owner_wait_s`), then refused with a
message naming that run. The lease is the same on a filesystem and in an object store. Two runs
that start within one request's round trip of each other can both believe they won: the second
check is a read after the write, not an atomic compare-and-swap, which fsspec does not offer.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass

from kiln.checkpoint.store import Location, store_for
from kiln.errors import ConfigError
from kiln.log import warn

OWNER = "OWNER"
# The holder renews every HEARTBEAT_S; a lease not renewed for EXPIRES_S is a dead run's. The gap
# covers a stalled store request or two; it is what a job restarted after a hard kill waits.
HEARTBEAT_S = 30.0
EXPIRES_S = 120.0
# How often a run waiting for another's lease looks again.
_POLL_S = 2.0


@dataclass(frozen=True)
class Owner:
    """Who holds a checkpoint location, as written in its OWNER file."""

    run: str  # the run's identity: runs with the same one share the location
    host: str
    pid: int
    run_dir: str
    heartbeat: float  # wall-clock time of the holder's last renewal

    def expired(self) -> bool:
        """Not renewed for EXPIRES_S: its run died without releasing it."""
        return time.time() - self.heartbeat > EXPIRES_S

    def is_this_process(self) -> bool:
        return (self.host, self.pid) == (socket.gethostname(), os.getpid())

    def describe(self) -> str:
        age = max(0.0, time.time() - self.heartbeat)
        return (
            f"run {self.run} (host {self.host}, pid {self.pid}, run dir {self.run_dir}; "
            f"alive {age:.0f} s ago)"
        )


def run_identity(*, fault_tolerant_dir: str | None) -> str:
    """This invocation's identity. A torchrun job's restarts share its rendezvous id (the launcher
    has stopped every worker of the failed attempt); a SLURM requeue counts as a new run, since
    its predecessor may still be finishing. The replica groups of a fault-tolerant run share the
    location they all write (`fault_tolerant_dir`)."""
    if fault_tolerant_dir is not None:
        return f"fault-tolerant:{fault_tolerant_dir}"
    elastic = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if elastic != "none":
        requeue = os.environ.get("SLURM_RESTART_COUNT")
        return f"torchrun:{elastic}" + (f":requeue-{requeue}" if requeue else "")
    return uuid.uuid4().hex[:12]


class Lease:
    """This process's hold on `root` (see the module docstring); call on rank 0 only."""

    def __init__(self, root: Location, *, run: str, run_dir: str):
        self.root, self.file, self.store = root, root / OWNER, store_for(root)
        self.run, self.run_dir = run, run_dir
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self, *, wait_s: float) -> None:
        """Hold `root`, waiting up to `wait_s` for another live run to release it."""
        deadline, told = time.monotonic() + wait_s, False
        while True:
            held = self.holder()
            if held is None or self._may_take(held):
                self._write()
                if (won := self.holder()) is None or won.run == self.run:
                    break
                held = won  # another run wrote at the same moment, and last
            left = deadline - time.monotonic()
            if left <= 0:
                raise ConfigError(
                    f"checkpoint.dir {self.root} is in use by {held.describe()}. Two runs "
                    "writing one checkpoint location would delete each other's saves: wait "
                    "for it to end (or raise checkpoint.owner_wait_s), or give this run its "
                    f"own checkpoint.dir. If that run is dead, delete {self.file}"
                )
            if not told:
                warn(f"{self.root} is held by {held.describe()}; waiting up to {wait_s:.0f} s")
                told = True
            time.sleep(min(_POLL_S, left))
        _release_held(self.root)  # an earlier hold of this process (tests build many runs)
        _HELD[str(self.root)] = self
        self._thread = threading.Thread(target=self._renew, name="kiln-lease", daemon=True)
        self._thread.start()

    def _may_take(self, held: Owner) -> bool:
        return held.run == self.run or held.is_this_process() or held.expired()

    def holder(self) -> Owner | None:
        """The owner recorded under `root` (None: none, or a file a crash left unreadable)."""
        try:
            return Owner(**json.loads(self.store.read_bytes(self.file).decode()))
        except (OSError, ValueError, TypeError):
            return None

    def _write(self) -> None:
        me = Owner(self.run, socket.gethostname(), os.getpid(), self.run_dir, time.time())
        self.store.write_own(self.file, (json.dumps(asdict(me)) + "\n").encode())

    def _renew(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                held = self.holder()
                if held is not None and held.run != self.run:
                    warn(f"{self.root} was taken over by {held.describe()}; no longer renewing")
                    return
                self._write()
            except OSError as error:  # the next renewal tries again; the lease outlives a few
                warn(f"could not renew the lease on {self.root}: {error}")

    def release(self) -> None:
        """Stop renewing and remove the OWNER file if it is still this run's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        held = self.holder()
        if held is not None and held.run == self.run and held.is_this_process():
            with contextlib.suppress(OSError):  # else it expires on its own
                self.store.remove_file(self.file)


_HELD: dict[str, Lease] = {}


def _release_held(root: Location) -> None:
    lease = _HELD.pop(str(root), None)
    if lease is not None:
        lease.release()


def release_all() -> None:
    """Release every lease this process holds (its runs ended, however)."""
    for root in list(_HELD):
        _HELD.pop(root).release()


atexit.register(release_all)
