"""torchft's lighthouse on the loopback interface, started by the fault-tolerance tests and
benchmark as the launch scripts start it: its own process, which a test can kill."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tests.distributed.launch import free_port

# A dead group is dropped after a heartbeat this long, and a quorum waits this long for groups
# that heartbeat but have not asked to join yet (the CLI's defaults, 5 s and 60 s, are made
# for clusters, where a group's restart takes minutes).
HEARTBEAT_TIMEOUT_MS = 1000
JOIN_TIMEOUT_MS = 1000


@contextlib.contextmanager
def lighthouse(log: Path, *, min_replicas: int = 1) -> Iterator[subprocess.Popen]:
    """A lighthouse on 127.0.0.1; its address is `proc.address`."""
    port = free_port()
    command = [
        str(Path(sys.executable).with_name("torchft_lighthouse")),
        f"--min_replicas={min_replicas}",
        f"--bind=127.0.0.1:{port}",
        f"--heartbeat_timeout_ms={HEARTBEAT_TIMEOUT_MS}",
        f"--join_timeout_ms={JOIN_TIMEOUT_MS}",
        "--quorum_tick_ms=50",
    ]
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    proc.address = f"http://127.0.0.1:{port}"
    try:
        _wait_listening(port, proc)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the lighthouse exited at start-up"
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise AssertionError(f"the lighthouse did not listen on port {port} in {timeout} s")
