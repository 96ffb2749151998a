"""Data: tokenizers, tokenized shard datasets, `kiln prepare`, and the built-in demo corpus."""

from kiln.data.dataset import TokenDataset
from kiln.data.demo_corpus import ensure_demo_corpus
from kiln.data.prepare import prepare_dataset
from kiln.data.shards import DatasetExistsError, ShardWriter, read_index
from kiln.data.tokenizer import (
    encode_ids,
    eos_id,
    load_tokenizer,
    tokenizer_hash,
    train_bpe_tokenizer,
)
from kiln.tokens import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN

__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "DatasetExistsError",
    "ShardWriter",
    "TokenDataset",
    "encode_ids",
    "ensure_demo_corpus",
    "eos_id",
    "load_tokenizer",
    "prepare_dataset",
    "read_index",
    "tokenizer_hash",
    "train_bpe_tokenizer",
]
