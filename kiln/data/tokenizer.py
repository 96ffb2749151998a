"""Tokenizers: load a local `tokenizer.json`, hash it, train a small byte-level BPE."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kiln.errors import KilnError
from kiln.tokens import EOS_CANDIDATES, EOS_TOKEN, SPECIAL_TOKENS

# 256 byte symbols plus the special tokens: a smaller vocabulary cannot encode every text.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a Hugging Face `tokenizer.json` from a local file (never from the hub)."""
    path = Path(path)
    if not path.is_file():
        raise KilnError(
            f"tokenizer file not found: {path} (pass the path to a local tokenizer.json)"
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:
        raise KilnError(
            f"{path} is not a valid tokenizer.json ({e}); pass a file saved by the "
            "Hugging Face `tokenizers` library"
        ) from None


def tokenizer_hash(path: str | Path) -> str:
    """sha256 hex digest of the tokenizer file, to tie a dataset to the tokenizer that made it."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer; decode(encode(s)) returns s exactly, whitespace included."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise KilnError(
            f"vocab_size {vocab_size} is too small for a byte-level BPE tokenizer; "
            f"use at least {MIN_VOCAB_SIZE}"
        )
    # No prefix space: adding one would make decode(encode(s)) differ from s.
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte gets a token even if unseen, so any text can be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def encode_ids(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, no special tokens added, encoded in parallel by Rust threads."""
    # encode_batch_fast skips offset tracking and is ~3x faster than encode_batch.
    return [
        encoding.ids for encoding in tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    ]


def find_eos_id(tokenizer: Tokenizer) -> int | None:
    """Id of the first known end-of-document token the tokenizer defines, or None."""
    for name in EOS_CANDIDATES:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return token_id
    return None


def eos_id(tokenizer: Tokenizer) -> int:
    """Id of the end-of-document token that separates documents in a token stream."""
    found = find_eos_id(tokenizer)
    if found is not None:
        return found
    raise KilnError(
        f"the tokenizer has no end-of-document token (looked for {', '.join(EOS_CANDIDATES)}); "
        f"add {EOS_TOKEN!r} as a special token or use a tokenizer that has one"
    )
