"""User-facing errors: the CLI prints their message and exits with code 2, no traceback."""


class KilnError(Exception):
    """A problem the user can fix (bad config, missing file, wrong checkpoint)."""


class ConfigError(KilnError):
    """The configuration is invalid; the message lists every problem found."""

    @classmethod
    def listing(cls, problems: list[str], source: object = None) -> "ConfigError":
        count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        head = f"invalid config{f' {source}' if source else ''} ({count}):"
        return cls("\n".join([head, *(f"  - {p}" for p in problems)]))
