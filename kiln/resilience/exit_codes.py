"""Exit codes of `kiln train` that launch scripts act on (docs/slurm.md)."""

ERROR = 2  # a user error or a failure with a message (bad config, NaN stop, dead peer)
PREEMPTED = 75  # EX_TEMPFAIL: stopped on SIGTERM/SIGUSR1 after writing a checkpoint; requeue
INTERRUPTED = 130  # stopped on Ctrl-C (SIGINT) after writing a checkpoint, as shells report it
HUNG = 124  # the step watchdog found a step running past resilience.step_timeout_s
