"""Text -> token shards, their tokenizer and meta.json, in one folder (`python -m mode.data prepare`).

    python -m mode.data prepare --out data/stdlib_bpe8k --train-bpe --vocab-size 8192
    python -m mode.data prepare --out data/notes --source text --path notes/ --tokenizer hf_model/

The text is the standard library's sources (the stdlib source the trainer reads as bytes), those and
every installed package's .py files (`--source python`: many times more text), a text file, or a
folder of them, split into train and validation as the byte-level sources split it (by
file, or by position where a split by file cannot give both sides text). It is read one file at a
time, in pieces of whole lines, encoded a batch of pieces at a time and appended to the current
shard: memory stays bounded whatever the corpus's size. The tokenizer is a Hugging Face model
folder's tokenizer.json, or a byte-level BPE trained here on the train split (tokenizers library).
Each document ends with the tokenizer's end-of-text id where it has one. Everything is written into
a temporary folder beside --out, which is renamed to --out at the end: an error or Ctrl-C leaves no
folder behind.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import IO, Iterator

import numpy as np
from tqdm import tqdm

from mode.data.meta import DTYPE_LIMITS, METADATA, SPLITS, TOKENIZER, DataError, Metadata, Shard, dtype_for
from mode.data.sources import _is_val_file, python_files, stdlib_files, stdlib_root, text_files
from mode.data.tokenizer import TextTokenizer, load_tokenizer, tokenizer_file

SEPARATOR = "<|endoftext|>"  # a trained BPE's document separator, its one special token
EOS_NAMES = (SEPARATOR, "</s>", "<|end_of_text|>", "<eos>")  # end-of-text tokens of common tokenizers
PIECE_BYTES = 1 << 20  # text is read in pieces of about this size, ending at a line's end
BATCH_BYTES = 8 << 20  # pieces encoded in one call (the library spreads them over its threads)
SHARD_TOKENS = 100_000_000


@dataclass
class Corpus:
    root: Path  # the split by file hashes file names relative to it
    files: list[Path]
    source: str  # "stdlib", "python" or "text"
    max_bytes: int | None = None  # read only the first max_bytes (whole lines)

    @cached_property
    def total_bytes(self) -> int:
        size = sum(f.stat().st_size for f in self.files)
        return size if self.max_bytes is None else min(size, self.max_bytes)


@dataclass
class Piece:
    split: str
    text: str
    ends_document: bool
    size: int  # bytes read for it


@dataclass
class SplitPlan:
    val_files: set[Path] | None  # the split by file, or None: by position
    cut: int  # by position: the byte offset where validation starts


def find_corpus(source: str, path: Path | None, max_bytes: int | None) -> Corpus:
    if source == "stdlib":
        corpus = Corpus(stdlib_root(), stdlib_files("--source stdlib"), "stdlib", max_bytes)
    elif source == "python":
        corpus = Corpus(*python_files(), "python", max_bytes)
    else:
        assert path is not None
        files = text_files(path, "--path")
        corpus = Corpus(path if path.is_dir() else path.parent, files, "text", max_bytes)
    if corpus.total_bytes == 0:
        where = f"--path: {path}" if source == "text" else f"--source {source}: the .py files under {corpus.root}"
        raise DataError(f"{where} is empty: there is no text to tokenize")
    return corpus


def plan_split(corpus: Corpus, val_fraction: float) -> SplitPlan:
    """By file (as the byte-level sources split), unless every file hashes to one side: then the last
    val_fraction of the text, by position."""
    files = _files_read(corpus)
    val = {f for f in files if _is_val_file(f.relative_to(corpus.root).as_posix(), val_fraction)}
    if val and len(val) < len(files):
        return SplitPlan(val, 0)
    total = corpus.total_bytes
    return SplitPlan(None, total - max(1, int(total * val_fraction)))


def _files_read(corpus: Corpus) -> list[Path]:
    """The files max_bytes lets the reader reach."""
    if corpus.max_bytes is None:
        return corpus.files
    files, size = [], 0
    for f in corpus.files:
        if size >= corpus.max_bytes:
            break
        files.append(f)
        size += f.stat().st_size
    return files


class Reader:
    """The corpus as pieces of text, each tagged with its split; counts files that are not UTF-8."""

    def __init__(self, corpus: Corpus, plan: SplitPlan, piece_bytes: int = PIECE_BYTES) -> None:
        self.corpus, self.plan, self.piece_bytes = corpus, plan, piece_bytes
        self.not_utf8: set[Path] = set()

    def pieces(self) -> Iterator[Piece]:
        offset, limit = 0, self.corpus.max_bytes
        for path in _files_read(self.corpus):
            for block, last in _blocks(path, self.piece_bytes):
                over = limit is not None and offset + len(block) > limit
                if over:  # the last piece read: its whole lines within the limit
                    block = block[:_lines_within(block, limit - offset)]
                yield from self._split(path, block, offset, last or over)
                offset += len(block)
                if over or (limit is not None and offset >= limit):
                    return

    def _split(self, path: Path, block: bytes, offset: int, last: bool) -> Iterator[Piece]:
        if self.plan.val_files is not None:
            yield Piece("val" if path in self.plan.val_files else "train", self._text(path, block), last, len(block))
            return
        cut = self.plan.cut
        head = len(block) if offset + len(block) <= cut else 0 if offset >= cut else _line_end(block, cut - offset)
        parts = [("train", block[:head]), ("val", block[head:])]
        parts = [(split, part) for split, part in parts if part]
        for i, (split, part) in enumerate(parts):
            yield Piece(split, self._text(path, part), last and i == len(parts) - 1, len(part))

    def _text(self, path: Path, data: bytes) -> str:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:  # tokenizers read str: undecodable bytes become U+FFFD
            self.not_utf8.add(path)
            return data.decode("utf-8", errors="replace")


def _blocks(path: Path, size: int) -> Iterator[tuple[bytes, bool]]:
    """The file in blocks of `size` to 2 x `size` bytes, each with whether it is the file's last. A block ends at
    a line's end, or, in a line longer than `size`, at a character's end: never inside a character."""
    with path.open("rb") as f:
        block = _block(f, size)
        while block:
            following = _block(f, size)
            yield block, not following
            block = following


def _block(f: IO[bytes], size: int) -> bytes:
    block = f.read(size)
    if not block:
        return block
    rest = f.readline(size)
    block += rest
    if len(rest) == size and not rest.endswith(b"\n"):  # a long line, cut: not inside a character
        keep = _characters_end(block)
        f.seek(keep - len(block), os.SEEK_CUR)
        block = block[:keep]
    return block


def _characters_end(data: bytes) -> int:
    """The length of data's whole UTF-8 characters: data less an incomplete character at its end."""
    start = len(data) - 1
    while start > len(data) - 4 and start > 0 and data[start] & 0xC0 == 0x80:  # continuation bytes
        start -= 1
    lead = data[start]
    width = 1 if lead < 0x80 else 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4 if lead >> 3 == 0b11110 else 1
    return start if start + width > len(data) and start > 0 else len(data)


def _lines_within(block: bytes, size: int) -> int:
    """The length of the block's whole lines within its first `size` bytes (at least its first line)."""
    return block.rfind(b"\n", 0, size) + 1 or _line_end(block, 0)


def _line_end(block: bytes, at: int) -> int:
    """The end of the line holding byte `at` (just past its newline), or the block's end."""
    newline = block.find(b"\n", at)
    return len(block) if newline < 0 else newline + 1


# ----------------------------------------------------------------------------- tokenizers
def train_bpe(reader: Reader, vocab_size: int, total: int) -> TextTokenizer:
    """A byte-level BPE (GPT-2's scheme: every byte has a token, so any text encodes) trained on the train split."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[SEPARATOR], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with _bar(total, "train BPE") as bar:

        def train_texts() -> Iterator[str]:
            for piece in reader.pieces():
                bar.update(piece.size)
                if piece.split == "train":
                    yield piece.text

        tokenizer.train_from_iterator(train_texts(), trainer)
    return TextTokenizer(tokenizer, Path(TOKENIZER))


def end_of_text(tokenizer: TextTokenizer, folder: Path | None) -> int | None:
    """The id that ends a document: a model folder's eos_token (tokenizer_config.json), else a common end-of-text token."""
    names = list(EOS_NAMES)
    config = folder / "tokenizer_config.json" if folder is not None else None
    if config is not None and config.is_file():
        try:
            eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            eos = None
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str):
            names.insert(0, eos)
    ids = [tokenizer.token_id(name) for name in names]
    return next((i for i in ids if i is not None), None)


def model_vocab(tokenizer: TextTokenizer, folder: Path | None) -> int:
    """The vocabulary a model of these tokens needs: the tokenizer's, or a model folder's config.json vocab_size
    where that is larger (Hugging Face models pad their embedding tables past the tokenizer)."""
    vocab = tokenizer.vocab_size
    config = folder / "config.json" if folder is not None else None
    if config is not None and config.is_file():
        try:
            declared = json.loads(config.read_text(encoding="utf-8")).get("vocab_size")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            declared = None
        if isinstance(declared, int) and not isinstance(declared, bool) and declared > vocab:
            vocab = declared
    return vocab


# ----------------------------------------------------------------------------- shards
class ShardWriter:
    """One split's ids, appended to `{split}_000000.bin`, `{split}_000001.bin`, ... of shard_tokens ids each."""

    def __init__(self, folder: Path, split: str, dtype: str, shard_tokens: int) -> None:
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, np.dtype(dtype), shard_tokens
        self.shards: list[Shard] = []
        self.file: IO[bytes] | None = None
        self.count = 0

    def write(self, ids: np.ndarray) -> None:
        ids = ids.astype(self.dtype, copy=False)
        while ids.size:
            if self.file is None:
                self.file = (self.folder / self._name()).open("wb")
            room = self.shard_tokens - self.count
            self.file.write(ids[:room].tobytes())
            self.count += min(room, ids.size)
            ids = ids[room:]
            if self.count == self.shard_tokens:
                self._end_shard()

    def close(self) -> list[Shard]:
        if self.file is not None:
            self._end_shard()
        return self.shards

    def abort(self) -> None:
        if self.file is not None:
            self.file.close()

    def _name(self) -> str:
        return f"{self.split}_{len(self.shards):06d}.bin"

    def _end_shard(self) -> None:
        assert self.file is not None
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        self.shards.append(Shard(self._name(), self.count))
        self.file, self.count = None, 0


def encode_corpus(reader: Reader, tokenizer: TextTokenizer, eos: int | None, writers: dict[str, ShardWriter],
                  total: int) -> dict[str, int]:
    """Every piece encoded and appended to its split's shards; returns the documents of each split."""
    documents = dict.fromkeys(SPLITS, 0)
    batch: list[Piece] = []

    def flush() -> None:
        per_split: dict[str, list[int]] = {split: [] for split in SPLITS}
        for piece, ids in zip(batch, tokenizer.encode_batch([p.text for p in batch]), strict=True):
            per_split[piece.split] += ids
            if piece.ends_document:
                documents[piece.split] += 1
                if eos is not None:
                    per_split[piece.split].append(eos)
        for split, ids in per_split.items():
            writers[split].write(np.asarray(ids, dtype=np.int64))
        bar.update(sum(p.size for p in batch))
        batch.clear()

    with _bar(total, "encode") as bar:
        size = 0
        for piece in reader.pieces():
            batch.append(piece)
            size += piece.size
            if size >= BATCH_BYTES:
                flush()
                size = 0
        flush()
    return documents


def _bar(total: int, what: str) -> tqdm:
    return tqdm(total=total, desc=what, unit="B", unit_scale=True, unit_divisor=1024, mininterval=1.0, file=sys.stderr)


# ----------------------------------------------------------------------------- the command
@dataclass
class Request:
    out: Path
    source: str
    path: Path | None
    tokenizer: Path | None
    vocab_size: int | None  # of a BPE to train
    val_fraction: float
    token_dtype: str  # auto, uint16 or uint32
    shard_tokens: int
    max_bytes: int | None


def check_request(r: Request) -> None:
    """Every flag's problem, before any text is read: one line naming the flag."""
    if not 0 < r.val_fraction < 1:
        raise DataError(f"--val-fraction {r.val_fraction}: must be between 0 and 1 (exclusive)")
    if r.shard_tokens < 1:
        raise DataError(f"--shard-tokens {r.shard_tokens}: must be at least 1")
    if r.max_bytes is not None and r.max_bytes < 1:
        raise DataError(f"--max-bytes {r.max_bytes}: must be at least 1")
    if r.source in ("stdlib", "python") and r.path is not None:
        raise DataError(f"--path {r.path}: --source {r.source} reads no path; give --source text for a file or folder")
    if r.source == "text" and r.path is None:
        raise DataError("--path: required with --source text (a text file or a folder of them)")
    if r.vocab_size is not None:
        if r.vocab_size <= 257:
            raise DataError(f"--vocab-size {r.vocab_size}: a byte-level BPE needs more than 257 tokens "
                            "(256 bytes and the document separator)")
        _check_fits(r.vocab_size, r.token_dtype, f"--vocab-size {r.vocab_size}")
    check_out(r.out)


def _check_fits(vocab: int, dtype: str, what: str) -> None:
    if dtype != "auto" and vocab > DTYPE_LIMITS[dtype]:
        raise DataError(f"{what}: a vocabulary of {vocab} tokens does not fit --token-dtype {dtype} (ids below "
                        f"{DTYPE_LIMITS[dtype]}): use uint32 or auto")


def check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out}: is a file; give a new or empty folder")
    if out.is_dir():
        held = sorted(p.name for p in out.iterdir())
        if held:
            shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
            raise DataError(f"--out {out}: holds other files ({shown}); give a new or empty folder")
    for parent in out.resolve().parents:  # the nearest one that exists decides
        if parent.exists():
            if not parent.is_dir():
                raise DataError(f"--out {out}: lies under {parent}, which is a file, not a folder")
            break


def prepare(r: Request) -> Metadata:
    """Write the folder r.out: shards, tokenizer.json, meta.json (built beside it, renamed at the end)."""
    check_request(r)
    corpus = find_corpus(r.source, r.path, r.max_bytes)
    plan = plan_split(corpus, r.val_fraction)
    total = corpus.total_bytes
    source_tokenizer = None
    if r.tokenizer is not None:
        source_tokenizer = tokenizer_file(r.tokenizer, "--tokenizer")
        tokenizer = load_tokenizer(r.tokenizer)
        folder = r.tokenizer if r.tokenizer.is_dir() else None
        vocab, eos = model_vocab(tokenizer, folder), end_of_text(tokenizer, folder)
        _check_fits(vocab, r.token_dtype, f"--tokenizer {r.tokenizer}")
    else:
        assert r.vocab_size is not None
        tokenizer = train_bpe(Reader(corpus, plan), r.vocab_size, total)
        vocab, eos = tokenizer.vocab_size, tokenizer.token_id(SEPARATOR)
    dtype = dtype_for(vocab) if r.token_dtype == "auto" else r.token_dtype
    out = r.out.resolve()  # "." or "data/.." name their folder only once resolved
    out.parent.mkdir(parents=True, exist_ok=True)
    work = out.parent / f".{out.name}.partial-{os.getpid()}"
    work.mkdir()
    writers = {split: ShardWriter(work, split, dtype, r.shard_tokens) for split in SPLITS}
    try:
        reader = Reader(corpus, plan)
        documents = encode_corpus(reader, tokenizer, eos, writers, total)
        shards = {split: writers[split].close() for split in SPLITS}
        meta = Metadata(
            vocab_size=vocab, token_dtype=dtype, tokenizer=TOKENIZER, val_fraction=r.val_fraction, shards=shards,
            eos_token_id=eos, info=_info(r, corpus, plan, documents, reader, tokenizer),
        )
        _check_splits(meta, r)
        if source_tokenizer is not None:
            shutil.copyfile(source_tokenizer, work / TOKENIZER)
        else:
            tokenizer.tokenizer.save(str(work / TOKENIZER))
        (work / METADATA).write_text(meta.to_json(), encoding="utf-8")
        os.rename(work, out)  # onto a missing or empty folder: the whole folder appears at once
    except BaseException:
        for writer in writers.values():
            writer.abort()
        shutil.rmtree(work, ignore_errors=True)
        raise
    return meta


def _check_splits(meta: Metadata, r: Request) -> None:
    for split in SPLITS:
        if meta.tokens(split) == 0:
            name = "validation" if split == "val" else "train"
            raise DataError(f"--val-fraction {r.val_fraction}: the corpus is too small to give the {name} split "
                            "any text; give more text or another --val-fraction")


def _info(r: Request, corpus: Corpus, plan: SplitPlan, documents: dict[str, int], reader: Reader,
          tokenizer: TextTokenizer) -> dict[str, object]:
    return {
        "source": corpus.source, "path": str(corpus.root.resolve() if r.path is None else r.path.resolve()),
        "bytes": corpus.total_bytes, "documents": documents, "split": "by_file" if plan.val_files else "by_position",
        "not_utf8_files": len(reader.not_utf8),
        "tokenizer_from": str(r.tokenizer.resolve()) if r.tokenizer else f"byte-level BPE trained here ({tokenizer.vocab_size} tokens)",
    }


def parse_args(argv: list[str] | None) -> Request:
    parser = argparse.ArgumentParser(prog="python -m mode.data", description="Tokenize text for training.")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare", help="text -> token shards, tokenizer.json and meta.json in one folder",
                            description="Text -> token shards, tokenizer.json and meta.json in one folder.")
    p.add_argument("--out", type=Path, required=True, help="the folder to write (new, or empty)")
    p.add_argument("--source", choices=["stdlib", "python", "text"], default=None,
                   help="stdlib: the standard library's sources; python: those and the installed packages' .py "
                        "files; text: --path. Default: text with --path, else stdlib")
    p.add_argument("--path", type=Path, default=None, help="a text file or a folder of text files")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--tokenizer", type=Path, help="a tokenizer.json, or a Hugging Face model folder holding one")
    which.add_argument("--train-bpe", action="store_true", help="train a byte-level BPE on the train split")
    p.add_argument("--vocab-size", type=int, default=None, help="the trained BPE's vocabulary (with --train-bpe)")
    p.add_argument("--val-fraction", type=float, default=0.1, help="share of the text held out for validation")
    p.add_argument("--token-dtype", choices=["auto", "uint16", "uint32"], default="auto",
                   help="auto: uint16 when the vocabulary fits (65536 ids), else uint32")
    p.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS, help="tokens per shard file")
    p.add_argument("--max-bytes", type=int, default=None, help="read only the first N bytes of text (a quick trial)")
    args = parser.parse_args(argv)
    if args.train_bpe and args.vocab_size is None:
        parser.error("--train-bpe needs --vocab-size N")
    if args.tokenizer is not None and args.vocab_size is not None:
        parser.error("--vocab-size sizes a BPE trained with --train-bpe; --tokenizer brings its own vocabulary")
    source = args.source or ("text" if args.path is not None else "stdlib")
    return Request(args.out, source, args.path, args.tokenizer, args.vocab_size, args.val_fraction,
                   args.token_dtype, args.shard_tokens, args.max_bytes)


def summary(meta: Metadata, out: Path) -> str:
    shards = {split: f"{len(meta.shards[split])} shard" + "s" * (len(meta.shards[split]) > 1) for split in SPLITS}
    return (f"wrote {out}: {meta.tokens('train')} train tokens ({shards['train']}), {meta.tokens('val')} "
            f"validation tokens ({shards['val']}), vocabulary {meta.vocab_size} ({meta.token_dtype}); "
            f"train on it with --data.source=tokens --data.path={out}")


def main(argv: list[str] | None = None) -> int:
    from mode.cli import started
    from mode.utils import stop_how, stop_status, stops_on_signals

    started()
    request = parse_args(argv)
    with stops_on_signals():
        try:
            meta = prepare(request)
        except (DataError, OSError) as e:
            text = str(e) if isinstance(e, DataError) else f"{getattr(e, 'filename', None) or request.out}: {e.strerror or e}"
            print(f"error: {text}", file=sys.stderr)
            return 2
        except KeyboardInterrupt as stop:
            print(f"\n{stop_how(stop)}: nothing was written to {request.out}", file=sys.stderr)
            return stop_status(stop)
    if request.vocab_size is not None and meta.vocab_size < request.vocab_size:
        print(f"note: the BPE has {meta.vocab_size} tokens, not --vocab-size {request.vocab_size}: the train split "
              "ran out of pairs to merge", file=sys.stderr)
    print(summary(meta, request.out))
    return 0
