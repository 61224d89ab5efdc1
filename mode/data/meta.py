"""The metadata of a prepared token folder (meta.json), and how a run's config follows it.

`python -m mode.data prepare` writes a folder of token shards (`train_000000.bin`, `val_000000.bin`,
...: flat arrays of token ids, nanoGPT's layout), the tokenizer that made them and `meta.json`,
which says how to read them: the vocabulary, the ids' dtype, each split's shards and token counts.
A config with `data.source: tokens` and `data.path` at such a folder takes model.vocab_size,
data.token_dtype and data.val_fraction from it (apply_metadata). Imports no torch: config loading
and the prepare command read it.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mode.config import Config

METADATA = "meta.json"
TOKENIZER = "tokenizer.json"
FORMAT = "mode-tokens-v1"
SPLITS = ("train", "val")
DTYPE_LIMITS = {"uint16": 1 << 16, "uint32": 1 << 32}  # how many distinct ids each dtype holds


class DataError(ValueError):
    """A data source problem; the message names the file or folder."""


@dataclass(frozen=True)
class Shard:
    file: str  # name inside the folder
    tokens: int


@dataclass
class Metadata:
    vocab_size: int  # the model's vocabulary: every id is below it
    token_dtype: str
    tokenizer: str  # the tokenizer's file name inside the folder
    val_fraction: float
    shards: dict[str, list[Shard]]  # split -> its shards, in stream order
    eos_token_id: int | None = None  # the id that ends each document (None: documents run on)
    info: dict[str, Any] = field(default_factory=dict)  # where the text came from, counts: for people, not read back

    def tokens(self, split: str) -> int:
        return sum(s.tokens for s in self.shards[split])

    def to_json(self) -> str:
        record = {"format": FORMAT, **asdict(self)}
        record["tokens"] = {split: self.tokens(split) for split in SPLITS}
        return json.dumps(record, indent=2) + "\n"


def dtype_for(vocab_size: int) -> str:
    """The narrowest dtype whose range holds every id below vocab_size."""
    return "uint16" if vocab_size <= DTYPE_LIMITS["uint16"] else "uint32"


def is_prepared(path: Path) -> bool:
    return (path / METADATA).is_file()


def read_metadata(folder: Path) -> Metadata:
    """A folder's meta.json; anything missing or malformed is a DataError naming the file."""
    path = folder / METADATA
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: cannot read it as JSON ({e})") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise DataError(f"{path}: not the metadata of python -m mode.data prepare (no 'format: {FORMAT}' entry)")
    try:
        meta = Metadata(
            vocab_size=_number(record, "vocab_size", int), token_dtype=record["token_dtype"],
            tokenizer=str(record["tokenizer"]), val_fraction=_number(record, "val_fraction", float),
            shards={split: [Shard(str(s["file"]), _number(s, "tokens", int)) for s in record["shards"][split]]
                    for split in SPLITS},
            eos_token_id=record.get("eos_token_id"), info=record.get("info", {}),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{path}: malformed entry ({type(e).__name__}: {e})") from None
    problem = _problem(meta)
    if problem:
        raise DataError(f"{path}: {problem}")
    return meta


def _number(record: dict[str, Any], key: str, kind: type) -> Any:
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ValueError(f"{key} is {value!r}, not a number of type {kind.__name__}")
    return kind(value)


def _problem(meta: Metadata) -> str | None:
    if meta.token_dtype not in DTYPE_LIMITS:
        return f"token_dtype {meta.token_dtype!r} is not one of {list(DTYPE_LIMITS)}"
    if not 0 < meta.vocab_size <= DTYPE_LIMITS[meta.token_dtype]:
        return f"vocab_size {meta.vocab_size} does not fit token_dtype {meta.token_dtype}"
    if not 0 < meta.val_fraction < 1:
        return f"val_fraction {meta.val_fraction} is not between 0 and 1"
    eos = meta.eos_token_id
    if eos is not None and (isinstance(eos, bool) or not isinstance(eos, int) or not 0 <= eos < meta.vocab_size):
        return f"eos_token_id {eos!r} is not an id in the vocabulary"
    empty = [split for split in SPLITS if meta.tokens(split) == 0]
    if empty:
        return f"the {empty[0]} split has no tokens"
    if any("/" in s.file or s.file.startswith(".") for split in SPLITS for s in meta.shards[split]):
        return "a shard's file name is not a plain name inside the folder"
    return None


def prepared_folder(config: Config) -> Path | None:
    """The prepared folder a config's data is read from (data.source tokens, data.path holding meta.json), or None."""
    d = config.data
    if d.source != "tokens" or not d.path or not is_prepared(Path(d.path)):
        return None
    return Path(d.path)


def apply_metadata(config: Config) -> None:
    """Set model.vocab_size, data.token_dtype and data.val_fraction from a prepared folder's meta.json. A
    config that gives one of them another value is a ConfigError naming both. Nothing happens when the
    data is not a prepared folder (or not there yet: loading the data then says what is missing)."""
    from mode.config import ConfigError

    folder = prepared_folder(config)
    if folder is None:
        return
    try:
        meta = read_metadata(folder)
    except DataError as e:
        raise ConfigError(f"data.path: {e}") from None
    fields = ((config.model, "model.vocab_size", meta.vocab_size), (config.data, "data.token_dtype", meta.token_dtype),
              (config.data, "data.val_fraction", meta.val_fraction))
    for section, name, value in fields:
        key = name.split(".")[1]
        given = getattr(section, key)
        if key in section.model_fields_set and given != value:
            raise ConfigError(
                f"{name} is {given!r}, but data.path {folder} holds tokens prepared with {key} {value!r} "
                f"({folder / METADATA}): leave {name} out of the config (it follows the data) or set it to {value!r}"
            )
        setattr(section, key, value)
