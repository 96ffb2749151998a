"""User-facing errors: the CLI prints their message and exits with code 2, no traceback."""


class KilnError(Exception):
    """A problem the user can fix (bad config, missing file, wrong checkpoint)."""


class ConfigError(KilnError):
    """The configuration is invalid; the message lists every problem found."""
