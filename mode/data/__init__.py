"""Token streams for training and validation (mode.data.sources), and prepared token folders:
`python -m mode.data prepare` writes them (mode.data.prepare), meta.json describes them
(mode.data.meta), mode.data.tokenizer turns text into their ids and back."""
from mode.data.meta import METADATA, TOKENIZER, DataError, Metadata, apply_metadata, is_prepared, read_metadata
from mode.data.sources import (
    BYTE_VOCAB,
    DOC_SEPARATOR,
    ShardedTokens,
    Tokens,
    TokenSplits,
    _is_val_file,
    batch_generator,
    describe_source,
    load_prepared,
    load_splits,
    load_stdlib,
    load_text,
    load_token_file,
    sample_batch,
    stdlib_files,
    stdlib_root,
    text_files,
)

__all__ = [
    "BYTE_VOCAB", "DOC_SEPARATOR", "METADATA", "TOKENIZER", "DataError", "Metadata", "ShardedTokens", "TokenSplits",
    "Tokens", "_is_val_file", "apply_metadata", "batch_generator", "describe_source", "is_prepared", "load_prepared",
    "load_splits", "load_stdlib", "load_text", "load_token_file", "read_metadata", "sample_batch", "stdlib_files",
    "stdlib_root", "text_files",
]
