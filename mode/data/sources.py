"""Token streams for training and validation.

Sources:
- `stdlib` (default): the source files of the running Python's standard library, real text
  present on every machine, split into train and validation *by file*, deterministically.
- `text`: a user's text file, or a folder of text files (split by file; one file, or a
  folder too small for the hash to put files on both sides, is split by position).
- `tokens`: a pre-tokenized uint16/uint32 file in nanoGPT's `.bin` layout (a flat array of
  token ids); the last val_fraction of it is validation. The file is memory-mapped, as nanoGPT
  does: a batch reads its windows, never the whole file (a corpus larger than memory trains).
  Or a folder written by `python -m mode.data prepare` (mode.data.prepared): its shards, split
  and vocabulary as its meta.json records them.

Tokens are bytes (vocabulary 256) for the two text sources. Batches are drawn at random
offsets by a generator seeded from (seed, step), so a resumed run sees the same data as an
uninterrupted one without saving any sampler state.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from mode.config import DataConfig
from mode.data.meta import METADATA, DataError, is_prepared, read_metadata

BYTE_VOCAB = 256
DOC_SEPARATOR = b"\n\x00\n"  # marks file boundaries in the byte stream


class ShardedTokens:
    """Memory-mapped shards read as one stream of token ids: a window may span two shards. Has what
    sample_batch and the split checks use of a Tensor: numel() and indexing by a tensor of positions."""

    def __init__(self, shards: list[Tensor]) -> None:
        self.shards = shards
        sizes = torch.tensor([s.numel() for s in shards])
        self.starts = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])  # (n_shards + 1,)

    def numel(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: Tensor) -> Tensor:
        """Token ids (int64) at global positions `index`, of any shape."""
        flat = index.reshape(-1)
        which = torch.searchsorted(self.starts, flat, right=True) - 1  # the shard of each position
        out = torch.empty(flat.shape, dtype=torch.long)  # int64: torch indexes uint16/uint32 but cannot scatter them
        for s in which.unique().tolist():
            rows = which == s
            out[rows] = self.shards[s][flat[rows] - self.starts[s]].long()
        return out.view(index.shape)


Tokens = Tensor | ShardedTokens


@dataclass
class TokenSplits:
    train: Tokens  # (N_train,) token ids, stored compactly (uint8 bytes; uint16 / uint32 mapped from token files)
    val: Tokens  # (N_val,)
    vocab_size: int


def _is_val_file(relative: str, val_fraction: float) -> bool:
    """Deterministic, platform-independent split by a hash of the file's relative path (its bytes as the
    file system gives them: a name that is not UTF-8 hashes too)."""
    digest = hashlib.sha256(os.fsencode(relative)).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


def _bytes_to_tokens(chunks: list[bytes]) -> Tensor:
    data = DOC_SEPARATOR.join(chunks)
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())


def _split_files(root: Path, files: list[Path], val_fraction: float, what: str) -> TokenSplits:
    train, val = [], []
    for f in files:
        rel = f.relative_to(root).as_posix()
        (val if _is_val_file(rel, val_fraction) else train).append(f.read_bytes())
    if not train or not val:
        # Too few files for a split by file (every one hashed to one side): split the
        # concatenated text by position instead, the last val_fraction held out.
        return _split_tail(_bytes_to_tokens([f.read_bytes() for f in files]), val_fraction, BYTE_VOCAB, root)
    return TokenSplits(_bytes_to_tokens(train), _bytes_to_tokens(val), BYTE_VOCAB)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(field: str = "data.source=stdlib") -> list[Path]:
    """The standard library's .py files, sorted; `field` names the setting in the error when there are none."""
    root = stdlib_root()
    # The library itself, not installed third-party packages or the test suite's data files.
    files = sorted(
        p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts
    )
    if not files:
        raise DataError(f"{field}: no .py files found under {root}")
    return files


def package_roots() -> list[Path]:
    """The folders the running Python installs third-party packages into (site-packages / dist-packages)."""
    paths = sysconfig.get_paths()
    found = {Path(paths[key]).resolve() for key in ("purelib", "platlib")}
    return sorted(p for p in found if p.is_dir())


def python_files(field: str = "--source python") -> tuple[Path, list[Path]]:
    """The standard library's .py files and those of the installed packages, sorted, with the folder
    they share (the split by file hashes names relative to it): far more text than the standard
    library alone, for runs that would otherwise repeat it many times."""
    files = {p.resolve() for p in stdlib_files(field)}
    for root in package_roots():
        files.update(p.resolve() for p in root.rglob("*.py") if p.is_file())
    ordered = sorted(files)
    return Path(os.path.commonpath([p.parent for p in ordered])), ordered


def load_stdlib(val_fraction: float) -> TokenSplits:
    root = stdlib_root()
    return _split_files(root, stdlib_files(), val_fraction, f"standard library at {root}")


def text_files(path: Path, field: str = "data.path") -> list[Path]:
    """The text a path holds: the file itself, or a folder's non-empty files that are not hidden, sorted.
    A missing path, an empty folder or a device / FIFO is a DataError naming `field`."""
    if not path.exists():
        raise DataError(f"{field}: {path} does not exist")
    if path.is_dir():
        # Hidden files and everything under hidden folders (.git, .venv, ...) are not text to learn.
        files = sorted(p for p in path.rglob("*") if p.is_file() and not _hidden(p.relative_to(path)))
        files = [p for p in files if p.stat().st_size > 0]
        if not files:
            raise DataError(f"{field}: folder {path} holds no non-empty files")
        return files
    if not path.is_file():  # /dev/zero or a FIFO would be read until memory runs out, or forever
        raise DataError(f"{field}: {path} is not a regular file or a folder (a device, FIFO or socket); "
                        "give a text file or a folder of them")
    return [path]


def load_text(path: Path, val_fraction: float) -> TokenSplits:
    files = text_files(path)
    if len(files) > 1:
        return _split_files(path, files, val_fraction, f"data.path {path}")
    tokens = _bytes_to_tokens([files[0].read_bytes()])
    return _split_tail(tokens, val_fraction, BYTE_VOCAB, files[0])


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def load_token_file(path: Path, dtype: str, val_fraction: float) -> TokenSplits:
    if path.is_dir():
        raise DataError(f"data.path: {path} is a folder; data.source=tokens reads one .bin file of token ids, or a "
                        f"folder python -m mode.data prepare wrote (with its {METADATA}, which this one lacks)")
    if not path.exists():
        raise DataError(f"data.path: token file {path} does not exist")
    if not path.is_file():
        raise DataError(f"data.path: {path} is not a regular file (a device, FIFO or socket); give a .bin file of token ids")
    itemsize = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size == 0 or size % itemsize:
        raise DataError(f"data.path: {path} has {size} bytes, not a whole number of {dtype} tokens (or is empty)")
    # Copy-on-write mapping: pages are read when a batch touches them and nothing is written back;
    # writable, so torch shares the memory without a warning (no training code writes to it).
    mapped = np.memmap(path, dtype=dtype, mode="c")
    if dtype == "uint16" and _looks_like_uint32(mapped):
        raise DataError(
            f"data.path: {path} read as uint16 has a 0 in every other token, as a file of uint32 ids does: "
            "set data.token_dtype=uint32"
        )
    return _split_tail(torch.from_numpy(mapped), val_fraction, int(mapped.max()) + 1, path)


def load_prepared(folder: Path, dtype: str) -> TokenSplits:
    """A folder written by python -m mode.data prepare: each split's shards, memory-mapped, and the vocabulary
    its meta.json records. `dtype` (data.token_dtype, which load_config sets from meta.json) must agree."""
    meta = read_metadata(folder)
    if dtype != meta.token_dtype:
        raise DataError(f"data.token_dtype is {dtype}, but {folder / METADATA} says the tokens are {meta.token_dtype}: "
                        f"set data.token_dtype={meta.token_dtype} (or leave it out)")
    parts = {}
    for split, shards in meta.shards.items():
        mapped = [_map_shard(folder / shard.file, meta.token_dtype, shard.tokens) for shard in shards]
        parts[split] = mapped[0] if len(mapped) == 1 else ShardedTokens(mapped)
    return TokenSplits(parts["train"], parts["val"], meta.vocab_size)


def _map_shard(path: Path, dtype: str, tokens: int) -> Tensor:
    if not path.is_file():
        raise DataError(f"data.path: shard {path} is missing; prepare the folder again")
    size, itemsize = path.stat().st_size, np.dtype(dtype).itemsize
    if size != tokens * itemsize:
        raise DataError(f"data.path: shard {path} has {size} bytes, not the {tokens} {dtype} tokens its "
                        f"{METADATA} records (cut short or replaced); prepare the folder again")
    return torch.from_numpy(np.memmap(path, dtype=dtype, mode="c"))  # copy-on-write, as load_token_file maps


def _looks_like_uint32(tokens: np.ndarray, sample: int = 1 << 20) -> bool:
    """uint32 ids below 65536 read as uint16 (little-endian): every odd entry is a zero high half."""
    head = tokens[: 2 * sample]
    return head.size >= 64 and int(head[1::2].max()) == 0 and int(head[0::2].max()) > 0


def _split_tail(tokens: Tensor, val_fraction: float, vocab: int, path: Path) -> TokenSplits:
    if tokens.numel() == 0:
        raise DataError(f"data.path: {path} is empty")
    n_val = max(1, int(tokens.numel() * val_fraction))
    return TokenSplits(tokens[:-n_val], tokens[-n_val:], vocab)


def load_splits(cfg: DataConfig) -> TokenSplits:
    if cfg.source == "stdlib":
        splits = load_stdlib(cfg.val_fraction)
    elif cfg.source == "text":
        splits = load_text(Path(cfg.path), cfg.val_fraction)
    elif is_prepared(Path(cfg.path)):
        splits = load_prepared(Path(cfg.path), cfg.token_dtype)
    else:
        splits = load_token_file(Path(cfg.path), cfg.token_dtype, cfg.val_fraction)
    for name, part in (("train", splits.train), ("validation", splits.val)):
        if part.numel() < cfg.seq_len + 1:
            remedy = "raise data.val_fraction or lower data.seq_len" if name == "validation" else "lower data.seq_len"
            raise DataError(
                f"data: the {name} split of {describe_source(cfg)} has {part.numel()} tokens, fewer than "
                f"data.seq_len + 1 = {cfg.seq_len + 1}: {remedy}"
            )
    return splits


def describe_source(cfg: DataConfig) -> str:
    """Where a run's tokens come from, for messages: the standard library's folder, or data.path."""
    return f"the standard library at {stdlib_root()}" if cfg.source == "stdlib" else f"data.path {cfg.path}"


def sample_batch(tokens: Tokens, batch_size: int, seq_len: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Random windows: inputs (B, S) and next-token targets (B, S). A window may span two shards."""
    starts = torch.randint(0, tokens.numel() - seq_len, (batch_size,), generator=generator)
    window = starts.unsqueeze(1) + torch.arange(seq_len + 1)  # (B, S+1)
    chunk = tokens[window].long()
    return chunk[:, :-1], chunk[:, 1:]


def batch_generator(seed: int, step: int, micro_step: int) -> torch.Generator:
    """The generator for one micro-batch: a pure function of its coordinates, so resume is exact."""
    g = torch.Generator()
    g.manual_seed(hash((seed, step, micro_step)) & 0x7FFF_FFFF_FFFF_FFFF)
    return g
