"""kiln: PyTorch-native pretraining for decoder-only language models."""

__version__ = "0.1.0"
