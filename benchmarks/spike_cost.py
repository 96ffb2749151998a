"""The per-step cost of loss-spike skipping (`resilience.spike_action = "skip"`) on CPU.

Two trainers of one recipe side by side, spike skipping off and on (--window, 100: full after
that many steps, which the warm-up runs), alternating blocks of steps so drift in machine load
hits both alike; then the detector's host work alone (`SpikeGuard.crossed` and `record` on a full
window), timed apart. What the step adds besides: one read of the loss and gradient norm a step,
which on a GPU is a wait for the device (on CPU it is not).

    PYTHONPATH=.:benchmarks python benchmarks/spike_cost.py --steps 30 --repeats 7 \
        [--window 100] [--config RECIPE] [--section.key=value ...]
"""

from __future__ import annotations

import argparse
import statistics
import timeit

from overhead import alternate_blocks, endless_trainer, time_steps

from kiln.config.sections import ResilienceConfig
from kiln.resilience.spike_guard import SpikeGuard

WINDOW = 100


def detector_us(repeats: int = 20_000) -> float:
    """Microseconds of the detector's host work a step, on a full window."""
    guard = SpikeGuard(ResilienceConfig(spike_action="skip", spike_window=WINDOW))
    for i in range(WINDOW):
        guard.record(3.0 + 1e-3 * (i % 7), 1.0 + 1e-3 * (i % 5), skipped=False)

    def one_step():
        guard.crossed(3.001, 1.002)
        guard.record(3.001, 1.002, skipped=False)

    return 1e6 * min(timeit.repeat(one_step, number=repeats, repeat=5)) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/train/debug.toml")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--window", type=int, default=WINDOW)
    args, overrides = parser.parse_known_args()
    off = endless_trainer(args.config, overrides)
    spikes = ["--resilience.spike_action=skip", f"--resilience.spike_window={args.window}"]
    on = endless_trainer(args.config, [*overrides, *spikes])
    time_steps(off.train_step, args.window + 5)  # the window fills: then every step decides
    time_steps(on.train_step, args.window + 5)
    times = alternate_blocks({"off": off, "on": on}, steps=args.steps, repeats=args.repeats)
    off_ms, on_ms = (1e3 * statistics.median(times[k]) for k in ("off", "on"))
    print(f"config {args.config} {' '.join(overrides)}")
    print("| spike_action | median step (ms) | min (ms) | max (ms) |")
    print("|---|---:|---:|---:|")
    for name, ms in (("none", off_ms), ("skip", on_ms)):
        key = "off" if name == "none" else "on"
        print(f"| {name} | {ms:.2f} | {1e3 * min(times[key]):.2f} | {1e3 * max(times[key]):.2f} |")
    print(
        f"\nskip / none = {on_ms / off_ms:.3f}x; the detector alone: {detector_us():.1f} µs a step"
    )


if __name__ == "__main__":
    main()
