"""The memory and throughput model behind `kiln check`'s estimates and `kiln plan`:
hardware.py (GPUs and interconnects), model_state.py, activations.py and memory.py (bytes per GPU
by term), throughput.py (compute, each collective, the overlap rule), search.py (every valid
layout, ranked), report.py (what the commands print). Pure arithmetic on the config: nothing is
allocated."""
