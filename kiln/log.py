"""kiln's messages to the user, through one logger ("kiln"): each line reads `kiln: <message>`.

The bottom layer: it imports nothing of kiln, so every subsystem may use it. Its handler is set up
once, on the first message, on the "kiln" logger alone: the root logger, and whatever an
application configured there, is left as it was, and kiln's lines do not reach it. The handler
writes to `sys.stderr` (or `sys.stdout`) as it is at the moment, so a redirected or captured
stream (pytest's capsys, contextlib.redirect_stderr) gets the lines.

What is not a message stays a print: the per-step metrics line (kiln/metrics/logger.py) and the
reports a command prints as its output. A signal handler writes with os.write instead
(kiln/resilience/preemption.py): logging takes locks and is not async-signal-safe.
"""

from __future__ import annotations

import logging
import sys

LOGGER_NAME = "kiln"
_HANDLER_NAME = "kiln-stream"
_TO_STDOUT = "kiln_to_stdout"  # the record attribute that picks stdout


def info(message: str, *, stdout: bool = False) -> None:
    """A note for the user on stderr; with `stdout`, on stdout, where the run's progress is
    read (which checkpoint it resumed from, what it tokenizes)."""
    logger().info(message, extra={_TO_STDOUT: stdout})


def warn(message: str) -> None:
    """Something the user should act on or know went differently, on stderr."""
    logger().warning(message)


def logger() -> logging.Logger:
    """The "kiln" logger, with its handler added the first time (and only then)."""
    log = logging.getLogger(LOGGER_NAME)
    if not any(handler.get_name() == _HANDLER_NAME for handler in log.handlers):
        handler = _StreamOfTheMoment()
        handler.set_name(_HANDLER_NAME)
        handler.setFormatter(logging.Formatter("kiln: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


class _StreamOfTheMoment(logging.Handler):
    """Writes each record to sys.stderr, or sys.stdout, as they are when it is written, and
    flushes: a line is out before a crash or an os._exit that follows it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stdout if getattr(record, _TO_STDOUT, False) else sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)
