"""Text data for the training job: corpus, tokenization, a token cache, and a batch sampler.

The default corpus is the Python standard library source of the running interpreter (its ``*.py``
files in sorted order; ``site-packages`` and the generated codec tables of ``encodings`` left out), capped at
``max_bytes`` of text. ``data_path`` names a text file or a directory of text files instead (read recursively in sorted order; files with
a NUL byte in their first 8 KiB are taken for binary and skipped; undecodable bytes become U+FFFD).

Cache layout, under ``cache_dir/<source name>-<key>/``: ``tokens.bin`` (every token, uint16 when
the vocabulary fits, else uint32; the last ``val_fraction`` of it is the validation split),
``tokenizer.json`` (BPE only) and ``meta.json``, written last so that its presence marks a complete
cache. ``meta.json`` holds a fingerprint of the sources (paths, sizes, mtimes) and of the settings:
a changed corpus is rebuilt, and a corrupted cache is rebuilt with a warning.

Batches (``get_batch``): each data-parallel rank owns a contiguous shard, ``1/world_size`` of the
split, and reads ``batch_size`` windows at offsets drawn uniformly within its shard by a generator
seeded with (seed, step, rank, split). Ranks therefore never read the same tokens, and a batch depends
on its step number only, so a run resumed at step s reads what it would have read uninterrupted
(given the same world size: the shards change with it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .tokenizer import TOKENIZER_KINDS, BPETokenizer, ByteTokenizer

__all__ = [
    "DEFAULT_MAX_BYTES",
    "TokenDataset",
    "prepare_data",
    "sample_offsets",
    "get_batch",
    "stdlib_dir",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 8_000_000  # ~8 MB of text: BPE training and encoding take seconds on 2 cores
CACHE_FORMAT_VERSION = 1
_BINARY_SNIFF_BYTES = 8192  # like git: a NUL byte near the start means binary
_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
# Generated charmap tables: 1.4 MB of the first 8 MB, and they teach the model nothing but hex.
_STDLIB_SKIPPED_DIRS = _SKIPPED_DIRS | {"encodings"}
_SPLITS = {"train": 0, "val": 1}


def stdlib_dir() -> Path:
    """Directory of the running interpreter's standard library (that of ``os.__file__``)."""
    return Path(os.__file__).resolve().parent


def _is_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(_BINARY_SNIFF_BYTES)


def _candidate_files(root: Path, suffix: str | None, skipped_dirs: set[str]) -> list[Path]:
    """Regular files under ``root`` in sorted relative-path order, hidden entries and
    ``skipped_dirs`` left out."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skipped_dirs and not d.startswith(".")]
        for name in filenames:
            if name.startswith(".") or (suffix and not name.endswith(suffix)):
                continue
            path = Path(dirpath) / name
            if path.is_file():
                found.append(path)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _select_sources(data_path: str | Path | None, max_bytes: int) -> tuple[Path, list[Path]]:
    """The corpus root and the text files read from it, in order, until ``max_bytes``.

    Raises:
        FileNotFoundError: if ``data_path`` does not exist.
        ValueError: if it holds no text file.
    """
    if data_path is None:
        root, files = stdlib_dir(), _candidate_files(stdlib_dir(), ".py", _STDLIB_SKIPPED_DIRS)
    else:
        root = Path(data_path).expanduser().resolve()
        if not root.exists():
            raise FileNotFoundError(f"data path {str(data_path)!r} does not exist")
        files = [root] if root.is_file() else _candidate_files(root, None, _SKIPPED_DIRS)
    selected, total = [], 0
    for path in files:
        if total >= max_bytes:
            break
        size = path.stat().st_size
        if size == 0 or _is_binary(path):
            continue
        selected.append(path)
        total += size
    if not selected:
        raise ValueError(f"data path {str(root)!r} holds no usable text (empty or binary files only)")
    return root, selected


def _read_texts(files: list[Path], max_bytes: int) -> list[str]:
    """Text of each file, undecodable bytes replaced, the total cut at ``max_bytes`` bytes."""
    texts, remaining = [], max_bytes
    for path in files:
        with open(path, "rb") as f:
            raw = f.read(remaining)
        remaining -= len(raw)
        texts.append(raw.decode("utf-8", errors="replace"))
        if remaining <= 0:
            break
    return texts


def _fingerprint(root: Path, files: list[Path], settings: dict) -> str:
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for path in files:
        st = path.stat()
        rel = path.relative_to(root).as_posix() if path != root else path.name
        h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


@dataclass
class TokenDataset:
    """Tokenized corpus, memory-mapped from the cache.

    Attributes:
        train, val: 1-D read-only uint16/uint32 arrays of token ids (disjoint: val follows train).
        tokenizer: ``ByteTokenizer`` or ``BPETokenizer`` (``encode``/``decode``).
        meta: the cache's metadata (source, fingerprint, dtype, token counts, split point).
        cache_dir: directory holding this corpus's cache files.
        from_cache: True when loaded from an existing cache, False when just built.
    """

    train: np.ndarray
    val: np.ndarray
    tokenizer: ByteTokenizer | BPETokenizer
    meta: dict
    cache_dir: Path
    from_cache: bool

    @property
    def vocab_size(self) -> int:
        """Number of token ids the model must embed (the tokenizer's actual vocabulary size)."""
        return self.tokenizer.vocab_size

    def split(self, name: str) -> np.ndarray:
        """The ``"train"`` or ``"val"`` token array. Raises ValueError for another name."""
        if name not in _SPLITS:
            raise ValueError(f"split must be 'train' or 'val', got {name!r}")
        return self.train if name == "train" else self.val

    def get_batch(self, split: str, batch_size: int, seq_len: int, *, rank: int = 0,
                  world_size: int = 1, seed: int = 0, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) int64 tensors of shape (batch_size, seq_len), y = x shifted by one token.
        See ``get_batch`` (module level) for the sampling scheme and errors."""
        return get_batch(self.split(split), batch_size, seq_len, rank=rank, world_size=world_size,
                         seed=seed, step=step, split_id=_SPLITS[split])

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids) -> str:
        """Text of a sequence of token ids (list, array or 1-D tensor)."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self.tokenizer.decode(ids)


def sample_offsets(num_tokens: int, batch_size: int, seq_len: int, *, rank: int = 0,
                   world_size: int = 1, seed: int = 0, step: int = 0, split_id: int = 0) -> np.ndarray:
    """Start indices (int64, shape (batch_size,)) of the windows of ``seq_len + 1`` tokens that
    ``rank`` reads at ``step``: uniform within the rank's contiguous shard
    ``[rank * shard, (rank + 1) * shard)``, ``shard = num_tokens // world_size``. The generator is
    seeded with ``[seed, step, rank, split_id]`` (non-negative ints), so any step can be replayed.

    Raises:
        ValueError: for a rank outside [0, world_size), non-positive sizes, or a shard shorter than
            seq_len + 1 tokens.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
    if batch_size <= 0 or seq_len <= 0:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")
    shard = num_tokens // world_size
    if shard < seq_len + 1:
        raise ValueError(
            f"each of {world_size} rank(s) gets {shard} tokens of a {num_tokens}-token split, "
            f"fewer than seq_len + 1 = {seq_len + 1}; use more data or a shorter seq_len"
        )
    rng = np.random.default_rng([seed, step, rank, split_id])
    return rank * shard + rng.integers(0, shard - seq_len, size=batch_size, dtype=np.int64)


def get_batch(tokens: np.ndarray, batch_size: int, seq_len: int, *, rank: int = 0,
              world_size: int = 1, seed: int = 0, step: int = 0,
              split_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets from ``tokens`` for one rank at one step.

    Returns:
        x, y: (batch_size, seq_len) int64 CPU tensors; ``y[:, t] == x[:, t + 1]`` for t < seq_len - 1.
    Raises:
        ValueError: as ``sample_offsets``.
    """
    offsets = sample_offsets(len(tokens), batch_size, seq_len, rank=rank, world_size=world_size,
                             seed=seed, step=step, split_id=split_id)
    windows = np.asarray(tokens[offsets[:, None] + np.arange(seq_len + 1)], dtype=np.int64)
    windows = torch.from_numpy(windows)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def _cache_name(root: Path, data_path, settings: dict) -> str:
    name = "stdlib" if data_path is None else (root.stem or "data")
    key = hashlib.sha256(json.dumps([str(root), settings], sort_keys=True).encode()).hexdigest()
    return f"{name}-{key[:12]}"


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")  # per process: ranks may race here
    write(tmp)
    os.replace(tmp, path)


def _load_cache(directory: Path, fingerprint: str) -> TokenDataset | None:
    """The cached dataset, or None when it is absent, stale or corrupted (warning on corruption)."""
    meta_path = directory / "meta.json"
    if not meta_path.exists():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("fingerprint") != fingerprint:
            logger.info("corpus or settings changed: rebuilding the token cache in %s", directory)
            return None
        dtype = np.dtype(meta["dtype"])
        num_tokens, split_at = int(meta["num_tokens"]), int(meta["split"])
        tokens_path = directory / "tokens.bin"
        size = tokens_path.stat().st_size
        if size != num_tokens * dtype.itemsize or not 0 < split_at < num_tokens:
            raise ValueError(f"tokens.bin holds {size} bytes, meta.json expects "
                             f"{num_tokens} x {dtype.itemsize} split at {split_at}")
        if meta["tokenizer"] == "bpe":
            tokenizer = BPETokenizer.load(directory / "tokenizer.json")
        else:
            tokenizer = ByteTokenizer()
        if tokenizer.vocab_size != meta["vocab_size"]:
            raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids, meta.json says {meta['vocab_size']}")
    except Exception as err:  # any damage at all means: build again
        warnings.warn(f"token cache in {directory} is corrupted ({err}); rebuilding it", stacklevel=3)
        return None
    tokens = np.memmap(tokens_path, dtype=dtype, mode="r", shape=(num_tokens,))
    return TokenDataset(tokens[:split_at], tokens[split_at:], tokenizer, meta, directory, True)


def prepare_data(cache_dir: str | Path, data_path: str | Path | None = None, *, tokenizer: str = "bpe",
                 vocab_size: int = 4096, max_bytes: int = DEFAULT_MAX_BYTES,
                 val_fraction: float = 0.05) -> TokenDataset:
    """Tokenize a corpus into the cache (or reuse the cache) and memory-map it.

    Args:
        cache_dir: directory for caches; each corpus and setting gets a subdirectory.
        data_path: a text file or a directory of text files; None for the Python standard library.
        tokenizer: ``"bpe"`` (byte-level BPE trained on the corpus) or ``"bytes"`` (vocabulary 256).
        vocab_size: BPE vocabulary size, at most (ignored for ``"bytes"``).
        max_bytes: at most this many bytes of text are read, files taken in sorted order.
        val_fraction: the last fraction of the tokens held out for validation (at least one token).
    Raises:
        FileNotFoundError: if data_path does not exist.
        ValueError: if it holds no usable text, the text is under 2 tokens, or an argument is invalid.
    """
    if tokenizer not in TOKENIZER_KINDS:
        raise ValueError(f"tokenizer must be one of {TOKENIZER_KINDS}, got {tokenizer!r}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    root, files = _select_sources(data_path, max_bytes)
    settings = {"version": CACHE_FORMAT_VERSION, "tokenizer": tokenizer, "max_bytes": max_bytes,
                "vocab_size": vocab_size if tokenizer == "bpe" else 256, "val_fraction": val_fraction}
    fingerprint = _fingerprint(root, files, settings)
    directory = Path(cache_dir).expanduser() / _cache_name(root, data_path, settings)
    cached = _load_cache(directory, fingerprint)
    if cached is not None:
        return cached

    texts = _read_texts(files, max_bytes)
    if tokenizer == "bpe":
        logger.info("training a %d-token BPE on %d files", vocab_size, len(texts))
        tok: ByteTokenizer | BPETokenizer = BPETokenizer.train(texts, vocab_size)
    else:
        tok = ByteTokenizer()
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 65536 else np.uint32)
    tokens = np.concatenate([np.asarray(ids, dtype=dtype) for ids in tok.encode_batch(texts)])
    if len(tokens) < 2:
        raise ValueError(f"data path {str(root)!r} gives {len(tokens)} token(s); need at least 2")
    split_at = len(tokens) - max(1, int(len(tokens) * val_fraction))
    meta = {
        "version": CACHE_FORMAT_VERSION, "fingerprint": fingerprint, "source": str(root),
        "num_files": len(texts), "text_bytes": sum(len(t.encode("utf-8")) for t in texts),
        "tokenizer": tokenizer, "vocab_size": tok.vocab_size, "dtype": dtype.name,
        "num_tokens": len(tokens), "split": split_at,
        "num_train_tokens": split_at, "num_val_tokens": len(tokens) - split_at,
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "meta.json").unlink(missing_ok=True)  # no stale meta may vouch for new files
    if tokenizer == "bpe":
        _atomic_write(directory / "tokenizer.json", tok.save)
    _atomic_write(directory / "tokens.bin", tokens.tofile)
    _atomic_write(directory / "meta.json", lambda p: p.write_text(json.dumps(meta, indent=2)))
    logger.info("cached %d tokens (%d train, %d val) in %s", len(tokens), split_at,
                len(tokens) - split_at, directory)
    mapped = np.memmap(directory / "tokens.bin", dtype=dtype, mode="r", shape=(len(tokens),))
    return TokenDataset(mapped[:split_at], mapped[split_at:], tok, meta, directory, False)
