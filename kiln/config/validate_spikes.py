"""Problems with loss-spike skipping ([resilience] spike_*), found before anything runs."""

from __future__ import annotations

from kiln.config.sections import JobConfig

# The mean and standard deviation of fewer applied steps than this flag ordinary noise.
MIN_SPIKE_WINDOW = 10


def spike_problems(cfg: JobConfig) -> list[str]:
    r, p = cfg.resilience, []
    if r.spike_action == "none":
        return p
    if r.spike_window < MIN_SPIKE_WINDOW:
        p.append(
            f"resilience.spike_window = {r.spike_window} is too short: the detector decides "
            f"only once its window holds that many applied steps, and the mean and standard "
            f"deviation of fewer than {MIN_SPIKE_WINDOW} flag ordinary noise as spikes. Use at "
            "least 10 (100 by default)"
        )
    for key in ("spike_loss_sigmas", "spike_grad_norm_sigmas"):
        if not getattr(r, key) > 0:
            p.append(
                f"resilience.{key} = {getattr(r, key)} must be > 0 (standard deviations above "
                "the window's mean); 6 is the default, inf leaves that metric out"
            )
    if r.spike_max_consecutive < 1:
        p.append(
            f"resilience.spike_max_consecutive must be >= 1 (skipped spikes in a row before "
            f"resilience.nan_action), got {r.spike_max_consecutive}"
        )
    return p
