"""Text data of the training job: corpus reading, tokenizers, the token cache, batches."""

import json
import os
import random

import numpy as np
import pytest
import torch

from zero_offload.train.data import TokenDataset, prepare_data, sample_offsets, stdlib_dir


def words_text(n_words=3000, seed=0):
    rng = random.Random(seed)
    vocab = ["def", "return", "self", "import", "class", "value", "for", "in", "range", "print",
             "lambda", "yield", "with", "open", "None", "True", "(", ")", ":", "\n    "]
    return " ".join(rng.choice(vocab) for _ in range(n_words)) + "\n"


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(words_text(), encoding="utf-8")
    return path


def all_tokens(data: TokenDataset) -> np.ndarray:
    return np.concatenate([data.train, data.val])


def test_text_file_with_byte_tokenizer(tmp_path, text_file):
    data = prepare_data(tmp_path / "cache", text_file, tokenizer="bytes", val_fraction=0.1)
    raw = text_file.read_bytes()
    assert data.vocab_size == 256 and data.train.dtype == np.uint16
    assert np.array_equal(all_tokens(data), np.frombuffer(raw, dtype=np.uint8))
    assert len(data.val) == int(len(raw) * 0.1) and data.meta["split"] == len(data.train)
    assert data.decode(torch.tensor([104, 105])) == "hi"
    assert not data.from_cache


def test_directory_skips_binary_and_replaces_bad_bytes(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("alpha text\n")
    (corpus / "sub" / "b.md").write_text("beta text\n")
    (corpus / "c.bin").write_bytes(b"\x89PNG\x00\x00BINARYDATA")
    (corpus / "d.txt").write_bytes(b"bad \xff\xfe bytes\n")
    (corpus / ".hidden").write_text("hidden\n")
    data = prepare_data(tmp_path / "cache", corpus, tokenizer="bytes")
    text = data.decode(all_tokens(data))
    assert data.meta["num_files"] == 3
    # Sorted by relative path (a.txt, d.txt, sub/b.md); the binary file skipped.
    assert text == "alpha text\nbad \ufffd\ufffd bytes\nbeta text\n"


def test_missing_and_empty_paths_are_named(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        prepare_data(tmp_path / "cache", missing)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty.txt"):
        prepare_data(tmp_path / "cache", empty)
    binary_only = tmp_path / "bin"
    binary_only.mkdir()
    (binary_only / "x.dat").write_bytes(b"\x00\x01\x02")
    with pytest.raises(ValueError, match="no usable text"):
        prepare_data(tmp_path / "cache", binary_only)
    with pytest.raises(ValueError, match="tokenizer"):
        prepare_data(tmp_path / "cache", None, tokenizer="words")


def test_max_bytes_caps_the_text(tmp_path, text_file):
    data = prepare_data(tmp_path / "cache", text_file, tokenizer="bytes", max_bytes=1000)
    assert len(all_tokens(data)) == 1000


def test_bpe_trains_round_trips_and_reuses_cache(tmp_path, text_file):
    cache = tmp_path / "cache"
    data = prepare_data(cache, text_file, tokenizer="bpe", vocab_size=300)
    assert 256 < data.vocab_size <= 300
    assert len(all_tokens(data)) < len(text_file.read_bytes())  # merges compress
    assert int(all_tokens(data).max()) < data.vocab_size
    sample = "def value(self):\n    return None  # ünïcode ✓\n"
    assert data.decode(data.encode(sample)) == sample
    assert data.decode(all_tokens(data)) == text_file.read_text()

    tokenizer_json = data.cache_dir / "tokenizer.json"
    stamp = tokenizer_json.stat().st_mtime_ns
    again = prepare_data(cache, text_file, tokenizer="bpe", vocab_size=300)
    assert again.from_cache and tokenizer_json.stat().st_mtime_ns == stamp
    assert np.array_equal(all_tokens(again), all_tokens(data))

    # A changed corpus rebuilds the cache.
    with open(text_file, "a") as f:
        f.write(words_text(200, seed=1))
    os.utime(text_file, ns=(stamp + 10**9, stamp + 10**9))
    changed = prepare_data(cache, text_file, tokenizer="bpe", vocab_size=300)
    assert not changed.from_cache and changed.cache_dir == data.cache_dir
    # Other settings get their own cache directory.
    other = prepare_data(cache, text_file, tokenizer="bytes")
    assert other.cache_dir != data.cache_dir


@pytest.mark.parametrize("damage", ["meta_garbage", "tokens_truncated", "tokenizer_missing"])
def test_corrupted_cache_is_rebuilt_with_warning(tmp_path, text_file, damage):
    cache = tmp_path / "cache"
    data = prepare_data(cache, text_file, tokenizer="bpe", vocab_size=300)
    expected = all_tokens(data).copy()
    del data  # release the memory map before damaging the file
    directory = next(cache.iterdir())
    if damage == "meta_garbage":
        (directory / "meta.json").write_text("{not json")
    elif damage == "tokens_truncated":
        with open(directory / "tokens.bin", "r+b") as f:
            f.truncate(10)
    else:
        (directory / "tokenizer.json").unlink()
    with pytest.warns(UserWarning, match="corrupted"):
        rebuilt = prepare_data(cache, text_file, tokenizer="bpe", vocab_size=300)
    assert not rebuilt.from_cache
    assert np.array_equal(all_tokens(rebuilt), expected)
    assert json.loads((directory / "meta.json").read_text())["num_tokens"] == len(expected)


def test_batches_shapes_shift_and_determinism(tmp_path, text_file):
    data = prepare_data(tmp_path / "cache", text_file, tokenizer="bytes")
    x, y = data.get_batch("train", 4, 16, seed=1, step=7)
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, y2 = data.get_batch("train", 4, 16, seed=1, step=7)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    x3, _ = data.get_batch("train", 4, 16, seed=1, step=8)
    x4, _ = data.get_batch("train", 4, 16, seed=2, step=7)
    assert not torch.equal(x, x3) and not torch.equal(x, x4)
    # The batch is the tokens at the sampled offsets.
    offsets = sample_offsets(len(data.train), 4, 16, seed=1, step=7)
    for row, start in zip(x, offsets):
        assert np.array_equal(row.numpy(), data.train[start:start + 16])


def test_ranks_read_disjoint_shards():
    num_tokens, seq_len, world = 10_000, 32, 4
    spans = []
    for rank in range(world):
        starts = np.concatenate([sample_offsets(num_tokens, 8, seq_len, rank=rank, world_size=world,
                                                step=s) for s in range(50)])
        spans.append((starts.min(), starts.max() + seq_len + 1))  # window end, exclusive
    for (lo_a, hi_a), (lo_b, _) in zip(spans, spans[1:]):
        assert lo_a < hi_a <= lo_b
    assert spans[-1][1] <= num_tokens
    with pytest.raises(ValueError, match="rank 4"):
        sample_offsets(num_tokens, 8, seq_len, rank=4, world_size=4)
    with pytest.raises(ValueError, match="seq_len"):
        sample_offsets(100, 8, 30, rank=0, world_size=4)


def test_validation_split_is_disjoint_from_train(tmp_path):
    path = tmp_path / "ab.txt"
    path.write_text("a" * 900 + "b" * 100)
    data = prepare_data(tmp_path / "cache", path, tokenizer="bytes", val_fraction=0.1)
    for step in range(20):
        x, y = data.get_batch("train", 8, 32, step=step)
        assert set(torch.cat([x, y]).unique().tolist()) == {ord("a")}
        x, y = data.get_batch("val", 8, 32, step=step)
        assert set(torch.cat([x, y]).unique().tolist()) == {ord("b")}
    with pytest.raises(ValueError, match="split"):
        data.get_batch("test", 1, 4)


def test_default_corpus_is_the_stdlib(tmp_path):
    data = prepare_data(tmp_path / "cache", tokenizer="bytes", max_bytes=50_000)
    assert data.meta["source"] == str(stdlib_dir())
    assert len(all_tokens(data)) == 50_000
    assert "import" in data.decode(all_tokens(data)[:20_000])
