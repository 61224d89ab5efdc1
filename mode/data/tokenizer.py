"""Text <-> token ids with a `tokenizers` tokenizer.json, exactly as `python -m mode.data prepare` encodes.

No special tokens are added (no BOS), and special tokens' text inside the input is encoded as text:
documents are ended by the separator id prepare appends, never by text that spells it. The
`tokenizers` library (the `hf` extra) is imported only when a tokenizer is loaded.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from mode.data.meta import TOKENIZER, DataError, is_prepared, read_metadata


class TextTokenizer:
    def __init__(self, tokenizer: Any, path: Path) -> None:
        self.tokenizer = tokenizer
        self.path = path  # the tokenizer.json it was read from (or will be saved to), for messages
        tokenizer.encode_special_tokens = True

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        # Special tokens are kept: a document separator the model wrote is seen in the output.
        return self.tokenizer.decode([int(t) for t in ids], skip_special_tokens=False)

    def token_id(self, text: str) -> int | None:
        return self.tokenizer.token_to_id(text)


def tokenizer_file(path: Path, field: str) -> Path:
    """The tokenizer.json `path` names: the file itself, a Hugging Face model folder's, or a prepared folder's."""
    if not path.exists():
        raise DataError(f"{field}: {path} does not exist")
    if path.is_dir():
        name = read_metadata(path).tokenizer if is_prepared(path) else TOKENIZER
        if not (path / name).is_file():
            raise DataError(f"{field}: folder {path} holds no {name} (a fast tokenizer's file, which "
                            "save_pretrained writes; a slow tokenizer's files alone cannot be read)")
        return path / name
    return path


def load_tokenizer(path: Path, field: str = "--tokenizer") -> TextTokenizer:
    """A TextTokenizer from a tokenizer.json, a folder holding one, or a prepared folder (its meta.json's)."""
    file = tokenizer_file(path, field)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError(f"{field}: reading {file} needs the tokenizers library: pip install -e '.[hf]'") from None
    try:
        return TextTokenizer(Tokenizer.from_file(str(file)), file)
    except Exception as e:  # the library raises its own exception type for a malformed file
        raise DataError(f"{field}: {file} is not a tokenizer.json the tokenizers library reads ({e})") from None
