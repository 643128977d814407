"""Tokenizers for the training job: raw UTF-8 bytes, or a byte-level BPE trained on the corpus.

Both have the same small face: ``kind``, ``vocab_size``, ``encode``, ``encode_batch``, ``decode``,
``save``. Byte-level BPE (GPT-2's scheme) never meets an unknown character: every string maps to
bytes first, so any text round-trips.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

__all__ = ["ByteTokenizer", "BPETokenizer", "TOKENIZER_KINDS"]

TOKENIZER_KINDS = ("bpe", "bytes")


class ByteTokenizer:
    """Each UTF-8 byte is a token: vocabulary 256, nothing to train or save."""

    kind = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        """Token ids (ints in [0, 256)) of the UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the byte ids; a sequence cut inside a UTF-8 character decodes to U+FFFD.

        Raises:
            ValueError: for an id outside [0, 256).
        """
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def save(self, path: str | Path) -> None:
        """Nothing to save: the byte tokenizer has no state."""


class BPETokenizer:
    """A byte-level BPE tokenizer (HF ``tokenizers``), trained on the corpus or loaded from JSON."""

    kind = "bpe"

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer

    @classmethod
    def train(cls, texts: Sequence[str], vocab_size: int) -> "BPETokenizer":
        """Train on ``texts``. The vocabulary holds the 256 byte symbols plus merges, up to
        ``vocab_size`` (fewer when a small corpus has no more pairs seen twice).

        Raises:
            ValueError: if vocab_size < 257 (no room for a single merge).
        """
        if vocab_size <= 256:
            raise ValueError(f"BPE vocab_size must exceed 256 (the byte alphabet), got {vocab_size}")
        tokenizer = Tokenizer(models.BPE())
        # add_prefix_space=False: source code must round-trip exactly.
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=2,  # a merge seen once is noise, not structure
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
            show_progress=False,
        )
        tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
        return cls(tokenizer)

    @classmethod
    def load(cls, path: str | Path) -> "BPETokenizer":
        """Load a tokenizer saved by ``save``.

        Raises:
            Exception: from ``tokenizers`` when the file is missing or not a tokenizer.
        """
        return cls(Tokenizer.from_file(str(path)))

    def save(self, path: str | Path) -> None:
        self._tokenizer.save(str(path))

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids (ints in [0, vocab_size)) of ``text``."""
        return self._tokenizer.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, encoded in parallel threads."""
        return [e.ids for e in self._tokenizer.encode_batch(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the ids; bytes cut inside a UTF-8 character decode to U+FFFD."""
        return self._tokenizer.decode([int(i) for i in ids])
