"""Which device a process trains on."""

from __future__ import annotations

import torch

from kiln.errors import ConfigError


def pick_device(name: str) -> torch.device:
    """`train.device`: "auto" takes the GPU when one is visible."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = 'cuda' but no GPU is visible; use 'auto' or 'cpu'")
    return torch.device(name)
