"""Data: the stdlib corpus split by file, text and token-file sources, clear errors, batches."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mode.config import DataConfig
from mode.data import (
    BYTE_VOCAB,
    DOC_SEPARATOR,
    DataError,
    _is_val_file,
    batch_generator,
    load_splits,
    load_stdlib,
    sample_batch,
    stdlib_root,
)

VAL_FRACTION = 0.1


def _bytes(t: torch.Tensor) -> bytes:
    return t.numpy().astype(np.uint8).tobytes()


# ----------------------------------------------------------------------------- stdlib
@pytest.fixture(scope="module")
def stdlib_splits():
    return load_stdlib(VAL_FRACTION)  # ~3 s: loaded once for the module


def _stdlib_files() -> list[Path]:
    root = stdlib_root()
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def test_stdlib_split_is_deterministic(stdlib_splits) -> None:
    again = load_stdlib(VAL_FRACTION)
    assert torch.equal(again.train, stdlib_splits.train)
    assert torch.equal(again.val, stdlib_splits.val)
    assert stdlib_splits.vocab_size == BYTE_VOCAB


def test_stdlib_split_is_by_file(stdlib_splits) -> None:
    """Each split is exactly the concatenation of its files: no file's bytes are in both."""
    root = stdlib_root()
    train, val = [], []
    for f in _stdlib_files():
        rel = f.relative_to(root).as_posix()
        (val if _is_val_file(rel, VAL_FRACTION) else train).append(f)
    assert train and val
    assert not set(train) & set(val)
    assert _bytes(stdlib_splits.val) == DOC_SEPARATOR.join(f.read_bytes() for f in val)
    assert _bytes(stdlib_splits.train) == DOC_SEPARATOR.join(f.read_bytes() for f in train)
    # The hash split sends roughly val_fraction of the files to validation.
    share = len(val) / (len(train) + len(val))
    assert 0.05 < share < 0.15, share
    # Standard library sources, not installed packages.
    assert not any("site-packages" in f.parts for f in train + val)


def test_is_val_file_is_stable() -> None:
    """The split must not depend on the process (no salted hash()): pinned values."""
    names = [f"pkg/module_{i}.py" for i in range(40)]
    chosen = [n for n in names if _is_val_file(n, 0.1)]
    # sha256 of the relative path: the same on every machine and in every version.
    assert chosen == ["pkg/module_5.py", "pkg/module_14.py", "pkg/module_26.py", "pkg/module_27.py",
                      "pkg/module_30.py", "pkg/module_32.py", "pkg/module_35.py", "pkg/module_36.py"]
    # Monotone in the fraction: a larger val_fraction only adds files to validation.
    assert set(chosen) <= {n for n in names if _is_val_file(n, 0.3)}


# ----------------------------------------------------------------------------- text sources
def _file_names(n_val: int, n_train: int, fraction: float) -> tuple[list[str], list[str]]:
    """Relative names that the hash split sends to validation / training."""
    val, train, i = [], [], 0
    while len(val) < n_val or len(train) < n_train:
        name = f"sub/doc_{i}.txt" if i % 2 else f"doc_{i}.txt"
        if _is_val_file(name, fraction):
            if len(val) < n_val:
                val.append(name)
        elif len(train) < n_train:
            train.append(name)
        i += 1
    return val, train


def test_small_text_folder_falls_back_to_a_split_by_position(tmp_path: Path) -> None:
    """Two files that both hash to training: the folder is split by position instead of failing."""
    fraction = 0.3
    _, train_names = _file_names(0, 2, fraction)
    folder = tmp_path / "corpus"
    for name in train_names:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(name.encode() * 50)
    splits = load_splits(DataConfig(source="text", path=str(folder), val_fraction=fraction, seq_len=8))
    whole = DOC_SEPARATOR.join((folder / n).read_bytes() for n in sorted(train_names))
    n_val = int(len(whole) * fraction)
    assert _bytes(splits.train) == whole[:-n_val] and _bytes(splits.val) == whole[-n_val:]


def test_text_folder_split_by_file(tmp_path: Path) -> None:
    fraction = 0.3
    val_names, train_names = _file_names(2, 4, fraction)
    folder = tmp_path / "corpus"
    contents = {}
    for j, name in enumerate(sorted(val_names + train_names)):
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        contents[name] = f"file {name}: " .encode() + bytes(range(j, j + 100))
        path.write_bytes(contents[name])
    (folder / ".hidden").write_bytes(b"not part of the corpus")
    (folder / ".git" / "objects").mkdir(parents=True)  # nor is anything under a hidden folder
    (folder / ".git" / "objects" / "pack").write_bytes(b"git internals")
    (folder / "empty.txt").write_bytes(b"")
    splits = load_splits(DataConfig(source="text", path=str(folder), val_fraction=fraction, seq_len=8))
    by_path = sorted(val_names + train_names)  # files are read in sorted path order
    expect_val = DOC_SEPARATOR.join(contents[n] for n in by_path if n in val_names)
    expect_train = DOC_SEPARATOR.join(contents[n] for n in by_path if n in train_names)
    assert _bytes(splits.val) == expect_val
    assert _bytes(splits.train) == expect_train
    assert splits.vocab_size == BYTE_VOCAB


def test_text_single_file_split_by_position(tmp_path: Path) -> None:
    data = bytes(np.random.default_rng(0).integers(0, 256, size=1000, dtype=np.uint8))
    path = tmp_path / "book.txt"
    path.write_bytes(data)
    splits = load_splits(DataConfig(source="text", path=str(path), val_fraction=0.2, seq_len=16))
    assert splits.val.numel() == 200
    assert _bytes(splits.train) + _bytes(splits.val) == data
    assert splits.train.dtype == torch.uint8
    # A folder with one non-empty file behaves like that file.
    folder = tmp_path / "one"
    folder.mkdir()
    (folder / "book.txt").write_bytes(data)
    (folder / "blank.txt").write_bytes(b"")
    same = load_splits(DataConfig(source="text", path=str(folder), val_fraction=0.2, seq_len=16))
    assert torch.equal(same.train, splits.train) and torch.equal(same.val, splits.val)


# ----------------------------------------------------------------------------- token files
@pytest.mark.parametrize("dtype, high", [("uint16", 65_535), ("uint32", 1_000_000)])
def test_token_file_round_trips_ids(tmp_path: Path, dtype: str, high: int) -> None:
    ids = np.random.default_rng(1).integers(0, high, size=500).astype(dtype)
    ids[7] = high  # the largest id sets the vocabulary
    path = tmp_path / f"tokens_{dtype}.bin"
    ids.tofile(path)
    splits = load_splits(DataConfig(source="tokens", path=str(path), token_dtype=dtype, val_fraction=0.1, seq_len=16))
    both = torch.cat([splits.train, splits.val]).numpy()
    np.testing.assert_array_equal(both.astype(np.int64), ids.astype(np.int64))
    assert splits.val.numel() == 50
    assert splits.vocab_size == high + 1
    # Ids survive batching: a window of the train split is the same ids.
    x, y = sample_batch(splits.train, 2, 16, batch_generator(0, 0, 0))
    assert x.dtype == torch.long and int(x.max()) < high + 1


def test_token_file_dtype_matters(tmp_path: Path) -> None:
    """uint32 ids read as uint16 would not round-trip: the dtype setting is honoured."""
    ids = np.arange(70_000, 70_100, dtype=np.uint32)
    path = tmp_path / "t.bin"
    ids.tofile(path)
    as16 = load_splits(DataConfig(source="tokens", path=str(path), token_dtype="uint16", seq_len=8))
    assert torch.cat([as16.train, as16.val]).numel() == 200  # twice as many, wrong ids
    as32 = load_splits(DataConfig(source="tokens", path=str(path), token_dtype="uint32", seq_len=8))
    assert torch.cat([as32.train, as32.val]).tolist() == ids.tolist()


# ----------------------------------------------------------------------------- errors
def test_missing_path_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_corpus"
    for source in ("text", "tokens"):
        with pytest.raises(DataError, match=str(missing)):
            load_splits(DataConfig(source=source, path=str(missing), seq_len=8))


def test_a_device_or_fifo_as_data_path_is_refused_naming_it(tmp_path: Path) -> None:
    """/dev/zero was read until memory ran out, and a FIFO would block forever: anything that is not a
    regular file or a folder is refused before it is opened."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for path in (Path("/dev/zero"), fifo):
        for source in ("text", "tokens"):
            with pytest.raises(DataError, match=rf"data.path: {path} is not a regular file"):
                load_splits(DataConfig(source=source, path=str(path), seq_len=8))


def test_empty_folder_and_empty_file_name_them(tmp_path: Path) -> None:
    folder = tmp_path / "empty_folder"
    folder.mkdir()
    with pytest.raises(DataError, match=str(folder)):
        load_splits(DataConfig(source="text", path=str(folder), seq_len=8))
    (folder / "blank.txt").write_bytes(b"")  # only empty files: still nothing to train on
    with pytest.raises(DataError, match=str(folder)):
        load_splits(DataConfig(source="text", path=str(folder), seq_len=8))
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match=str(empty)):
        load_splits(DataConfig(source="text", path=str(empty), seq_len=8))


def test_uint32_file_read_as_uint16_says_so(tmp_path: Path) -> None:
    path = tmp_path / "ids32.bin"
    np.random.default_rng(0).integers(1, 50_000, size=500, dtype=np.uint32).tofile(path)
    with pytest.raises(DataError, match="set data.token_dtype=uint32"):
        load_splits(DataConfig(source="tokens", path=str(path), token_dtype="uint16", seq_len=8))
    splits = load_splits(DataConfig(source="tokens", path=str(path), token_dtype="uint32", seq_len=8))
    assert splits.train.numel() + splits.val.numel() == 500


def test_folder_as_token_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=rf"{tmp_path} is a folder; data.source=tokens reads one .bin file"):
        load_splits(DataConfig(source="tokens", path=str(tmp_path), seq_len=8))


@pytest.mark.parametrize("dtype, n_bytes", [("uint16", 0), ("uint16", 3), ("uint32", 0), ("uint32", 6)])
def test_empty_or_odd_sized_token_file_names_it(tmp_path: Path, dtype: str, n_bytes: int) -> None:
    path = tmp_path / f"bad_{dtype}_{n_bytes}.bin"
    path.write_bytes(bytes(n_bytes))
    with pytest.raises(DataError, match=str(path)):
        load_splits(DataConfig(source="tokens", path=str(path), token_dtype=dtype, seq_len=8))


def test_corpus_shorter_than_a_sequence_names_seq_len(tmp_path: Path) -> None:
    path = tmp_path / "short.txt"
    path.write_bytes(b"a" * 100)  # val split: 10 bytes, fewer than seq_len + 1
    with pytest.raises(DataError, match=r"data\.seq_len"):
        load_splits(DataConfig(source="text", path=str(path), val_fraction=0.1, seq_len=16))
    ids = np.arange(20, dtype=np.uint16)
    bin_path = tmp_path / "short.bin"
    ids.tofile(bin_path)
    with pytest.raises(DataError, match=r"data\.seq_len"):
        load_splits(DataConfig(source="tokens", path=str(bin_path), val_fraction=0.5, seq_len=10))
    # Exactly seq_len + 1 tokens in each split is enough.
    ids = np.arange(22, dtype=np.uint16)
    ids.tofile(bin_path)
    splits = load_splits(DataConfig(source="tokens", path=str(bin_path), val_fraction=0.5, seq_len=10))
    assert splits.val.numel() == 11


# ----------------------------------------------------------------------------- batches
def test_sample_batch_targets_are_next_tokens() -> None:
    tokens = torch.arange(1000, dtype=torch.int32)
    x, y = sample_batch(tokens, 8, 32, batch_generator(0, 3, 0))
    assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.long
    assert torch.equal(y, x + 1)  # the corpus is 0, 1, 2, ...: the target is the next token
    assert torch.equal(x[:, 1:], y[:, :-1])
    # Windows are contiguous and stay inside the corpus.
    assert torch.equal(x, x[:, :1] + torch.arange(32))
    assert int(y.max()) <= 999 and int(x.min()) >= 0


def test_sample_batch_uses_every_token_of_a_minimal_corpus() -> None:
    tokens = torch.arange(17, dtype=torch.uint8)
    x, y = sample_batch(tokens, 4, 16, batch_generator(1, 0, 0))
    assert torch.equal(x, torch.arange(16).expand(4, 16))
    assert torch.equal(y, torch.arange(1, 17).expand(4, 16))


def test_batch_generator_is_a_function_of_its_coordinates() -> None:
    tokens = torch.arange(100_000, dtype=torch.int32)

    def batch(seed: int, step: int, micro: int) -> torch.Tensor:
        return sample_batch(tokens, 4, 16, batch_generator(seed, step, micro))[0]

    assert torch.equal(batch(0, 5, 1), batch(0, 5, 1))
    torch.manual_seed(123)  # the global RNG plays no part
    assert torch.equal(batch(0, 5, 1), batch(0, 5, 1))
    assert not torch.equal(batch(0, 5, 1), batch(0, 6, 1))  # another step
    assert not torch.equal(batch(0, 5, 1), batch(0, 5, 0))  # another micro-step
    assert not torch.equal(batch(0, 5, 1), batch(1, 5, 1))  # another seed
    assert not torch.equal(batch(0, 0, 0), batch(0, -1, 0))  # validation (step -1) vs training
    steps = {tuple(batch(0, s, 0)[:, 0].tolist()) for s in range(20)}
    assert len(steps) == 20


def test_batch_generator_is_the_same_in_another_process() -> None:
    """A resumed run is a new process: its batches must not depend on hash randomisation."""
    here = [batch_generator(7, s, m).initial_seed() for s in (0, 11) for m in (0, 3)]
    code = (
        "from mode.data import batch_generator\n"
        "print([batch_generator(7, s, m).initial_seed() for s in (0, 11) for m in (0, 3)])"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(here)


# ----------------------------------------------------------------------------- audit
@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_is_mapped_not_read_whole(tmp_path: Path, dtype: str) -> None:
    """The splits are views of a memory map of the file in its own dtype (nanoGPT's layout, read as
    nanoGPT reads it): no int32 copy of a corpus that may not fit in memory."""
    ids = np.arange(4096, dtype=dtype)
    path = tmp_path / "t.bin"
    ids.tofile(path)
    splits = load_splits(DataConfig(source="tokens", path=str(path), token_dtype=dtype, val_fraction=0.25, seq_len=16))
    assert splits.train.dtype == getattr(torch, dtype) and splits.val.dtype == getattr(torch, dtype)
    assert splits.val.data_ptr() == splits.train.data_ptr() + splits.train.numel() * ids.itemsize  # one mapping


def test_uint32_ids_past_int32_range_are_a_vocabulary_error(tmp_path: Path) -> None:
    """An id of 2**31 or more is counted as itself (a widening to int32 wrapped it negative, past the
    vocabulary check, to crash in the embedding): the error names the file and the dtype to try."""
    from mode.config import ConfigError, config_from_dict
    from mode.training.trainer import Trainer

    ids = np.arange(200, dtype=np.uint32)
    ids[5] = 2**31 + 3
    path = tmp_path / "big_ids.bin"
    ids.tofile(path)
    assert load_splits(DataConfig(source="tokens", path=str(path), token_dtype="uint32", seq_len=8)).vocab_size == 2**31 + 4
    raw = {"model": {"vocab_size": 256, "d_model": 16, "n_heads": 2, "n_layers": 1, "d_ff": 32, "max_seq_len": 8},
           "data": {"source": "tokens", "path": str(path), "token_dtype": "uint32", "seq_len": 8},
           "train": {"device": "cpu", "out_dir": str(tmp_path / "run"), "progress": False}}
    with pytest.raises(ConfigError, match=rf"vocabulary \(2147483652 token ids in data.path {path}\).*token_dtype=uint16"):
        Trainer(config_from_dict(raw))
    assert not (tmp_path / "run").exists()  # refused before the run folder was made


def test_a_file_name_that_is_not_utf8_is_split_like_any(tmp_path: Path) -> None:
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(30):
        (folder / f"f{i:02d}.txt").write_bytes(b"text %d " % i * 20)
    with open(os.path.join(os.fsencode(folder), b"caf\xe9.txt"), "wb") as f:
        f.write(b"latin-1 named file " * 20)
    splits = load_splits(DataConfig(source="text", path=str(folder), val_fraction=0.2, seq_len=8))
    assert splits.train.numel() + splits.val.numel() > 30 * 20 * 7
    assert _is_val_file("f00.txt", 0.2) == _is_val_file(os.fsdecode(b"f00.txt"), 0.2)


def test_a_short_validation_split_names_the_source_and_the_remedy(tmp_path: Path) -> None:
    path = tmp_path / "small.txt"
    path.write_bytes(b"x" * 200)
    with pytest.raises(DataError, match=rf"validation split of data.path {path} has 20 tokens.*raise data.val_fraction"):
        load_splits(DataConfig(source="text", path=str(path), val_fraction=0.1, seq_len=32))
