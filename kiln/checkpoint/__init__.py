from kiln.checkpoint.checkpointer import (
    load_checkpoint,
    read_model_config,
    read_train_state,
    save_checkpoint,
)
from kiln.checkpoint.layout import find_tokenizer, latest_complete, resolve_checkpoint
from kiln.checkpoint.saver import CheckpointSaver

__all__ = [
    "CheckpointSaver",
    "find_tokenizer",
    "latest_complete",
    "load_checkpoint",
    "read_model_config",
    "read_train_state",
    "resolve_checkpoint",
    "save_checkpoint",
]
