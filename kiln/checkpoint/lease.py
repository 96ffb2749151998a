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

from kiln.checkpoint.store import Location, missing_folders, remove_if_empty, store_for
from kiln.errors import ConfigError
from kiln.log import warn

OWNER = "OWNER"
# The holder renews every HEARTBEAT_S; a lease not renewed for EXPIRES_S is a dead run's. The gap
# covers a stalled store request or two; it is what a job restarted after a hard kill waits.
HEARTBEAT_S = 30.0
EXPIRES_S = 120.0
# How often a run waiting for another's lease looks again.
_POLL_S = 2.0
# This process, told apart from another with the same host name and pid (containers).
_PROCESS = uuid.uuid4().hex


@dataclass(frozen=True)
class Owner:
    """Who holds a checkpoint location, as written in its OWNER file."""

    run: str  # the run's identity: runs with the same one share the location
    host: str
    pid: int
    run_dir: str
    heartbeat: float  # wall-clock time of the holder's last renewal
    process: str = ""  # the holder's process, as _PROCESS

    def expired(self) -> bool:
        """Not renewed for EXPIRES_S: its run died without releasing it."""
        return time.time() - self.heartbeat > EXPIRES_S

    def is_this_process(self) -> bool:
        return self.process == _PROCESS

    def describe(self) -> str:
        age = max(0.0, time.time() - self.heartbeat)
        return (
            f"run {self.run} (host {self.host}, pid {self.pid}, run dir {self.run_dir}; "
            f"alive {age:.0f} s ago)"
        )


def owner_of(root: Location) -> Owner | None:
    """The owner recorded under `root` (None: none, or a file a crash left unreadable)."""
    try:
        return Owner(**json.loads(store_for(root).read_bytes(root / OWNER).decode()))
    except (OSError, ValueError, TypeError):
        return None


def run_identity(*, fault_tolerant: str | None) -> str:
    """This invocation's identity. A torchrun job's restarts share its rendezvous id (the launcher
    has stopped every worker of the failed attempt); a SLURM requeue counts as a new run, since
    its predecessor may still be finishing. The replica groups of a fault-tolerant run share one
    (`fault_tolerant`: what they have in common, the location and the lighthouse)."""
    if fault_tolerant is not None:
        return f"fault-tolerant:{fault_tolerant}"
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
        self.created = missing_folders(root)  # removed again if the run leaves them empty
        # Renewal (a background thread) and release exclude each other: a renewal after the
        # release would write the OWNER file back.
        self._lock = threading.Lock()
        self._released = False

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
                    f"checkpoint.dir {self.root} is in use by {held.describe()}; waited "
                    f"{wait_s:.0f} s. Two runs writing one checkpoint location would delete "
                    "each other's saves: wait for it to end (checkpoint.owner_wait_s, at most "
                    "80% of resilience.collective_timeout_s), or give this run its own "
                    f"checkpoint.dir. If that run is dead, delete {self.file}"
                )
            if not told:
                warn(f"{self.root} is held by {held.describe()}; waiting up to {wait_s:.0f} s")
                told = True
            time.sleep(min(_POLL_S, left))
        with _LOCK:
            earlier = _HELD.pop(str(self.root), None)  # this process's earlier run there
            _HELD[str(self.root)] = self
        if earlier is not None:
            earlier.release()
        _start_renewing()

    def _may_take(self, held: Owner) -> bool:
        return held.run == self.run or held.is_this_process() or held.expired()

    def holder(self) -> Owner | None:
        return owner_of(self.root)

    def _write(self) -> None:
        me = Owner(self.run, socket.gethostname(), os.getpid(), self.run_dir, time.time(), _PROCESS)
        text = (json.dumps(asdict(me)) + "\n").encode()
        for attempt in range(3):  # another job's start-up clean-up may remove a new folder
            try:
                self.store.write_own(self.file, text)
                return
            except (FileNotFoundError, FileExistsError):  # a folder made and removed meanwhile
                if attempt == 2:
                    raise

    def check_held(self) -> None:
        """Raise an OSError (a failed save on every rank) when another run took the location
        over: this one stalled past EXPIRES_S, and writing on would delete the other's saves."""
        held = self.holder()
        if held is not None and held.run != self.run:
            raise OSError(
                f"checkpoint.dir {self.root} was taken over by {held.describe()} while this run "
                "did not renew its lease; this run stops writing there"
            )

    def renew(self) -> bool:
        """Write a fresh heartbeat; False when the lease is no longer this run's to renew."""
        with self._lock:
            if self._released or not self.store.exists(self.root):
                return False  # released, or the location was deleted: nothing left to hold
            held = self.holder()
            if held is not None and held.run != self.run:
                warn(f"{self.root} was taken over by {held.describe()}; no longer renewing")
                return False
            self._write()
            return True

    def release(self) -> None:
        """Stop renewing and remove the OWNER file if it is still this run's."""
        with _LOCK:
            if _HELD.get(str(self.root)) is self:
                del _HELD[str(self.root)]
        with self._lock:
            self._released = True
            held = self.holder()
            if held is not None and held.run == self.run and held.is_this_process():
                with contextlib.suppress(OSError):  # else it expires on its own
                    self.store.remove_file(self.file)
            remove_if_empty(self.created)


# The leases this process holds, by location, and the one thread that renews them all.
_HELD: dict[str, Lease] = {}
_LOCK = threading.Lock()
_RENEWER: list[threading.Thread] = []


def _start_renewing() -> None:
    with _LOCK:
        if not _RENEWER:
            _RENEWER.append(threading.Thread(target=_renew_all, name="kiln-lease", daemon=True))
            _RENEWER[0].start()


def _renew_all() -> None:
    while True:
        time.sleep(HEARTBEAT_S)
        with _LOCK:
            held = list(_HELD.values())
        for lease in held:
            try:
                if not lease.renew():
                    lease.release()
            except OSError as error:  # tried again next time: the lease outlives a few misses
                warn(f"could not renew the lease on {lease.root}: {error}")


def release_all() -> None:
    """Release every lease this process holds (its runs ended, however)."""
    with _LOCK:
        held = list(_HELD.values())
    for lease in held:
        lease.release()


atexit.register(release_all)
