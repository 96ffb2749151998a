"""User-facing errors: the CLI prints their message and exits with code 2, no traceback."""


class KilnError(Exception):
    """A problem the user can fix (bad config, missing file, wrong checkpoint)."""


class RelayedError(KilnError):
    """Rank 0's error, received by another rank: rank 0 reports it, the others only stop."""


class ConfigError(KilnError):
    """The configuration is invalid; the message lists every problem found."""

    @classmethod
    def listing(cls, problems: list[str], source: object = None) -> "ConfigError":
        count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        head = f"invalid config{f' {source}' if source else ''} ({count}):"
        return cls("\n".join([head, *(f"  - {p}" for p in problems)]))


def first_line(error: BaseException) -> str:
    """The first line of an error's message, for one-line reports. A DCP CheckpointException
    wraps one error per rank in `failures`: the cause is wanted, not the wrapper."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        cause = next(iter(failures.values()))
        error = cause[0] if isinstance(cause, tuple | list) else cause
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
