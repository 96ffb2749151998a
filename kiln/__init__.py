"""kiln: PyTorch-native pretraining for decoder-only language models."""

from kiln.torch_version import require_supported_torch

__version__ = "0.1.0"

require_supported_torch()
