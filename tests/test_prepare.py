"""python -m mode.data prepare: token shards, tokenizer.json and meta.json; training and sampling on them.

The end-to-end test prepares the standard library's sources with a trained byte-level BPE of 8192
tokens (its first 3 MB: the whole library takes ~30 s more on two cores), trains a mod_tiny-shaped
model on it for a few steps and samples text from a text prompt.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mode.checkpoint import load_model
from mode.config import ConfigError, DataConfig, load_config
from mode.data import METADATA, DataError, ShardedTokens, _is_val_file, load_splits, read_metadata, sample_batch
from mode.data.meta import dtype_for
from mode.data.prepare import SEPARATOR, Corpus, Reader, SplitPlan, main
from mode.data.sources import python_files, stdlib_files
from mode.data.tokenizer import load_tokenizer
from mode.generate import generate
from mode.generate import main as generate_main
from mode.train import main as train_main

ROOT = Path(__file__).resolve().parents[1]
TEXTS = {  # UTF-8 beyond ASCII, and the separator's text, which must stay text
    "alpha.txt": "def alpha(x):\n    return x + 1  # naïve\n" * 40,
    "beta.txt": "class Beta:\n    '''Grüße, 世界'''\n    value = <|endoftext|>\n" * 30,
    "gamma.txt": "import os\nprint(os.getcwd())\n" * 50,
    "delta.txt": "for i in range(10):\n    print(i * i)\n" * 45,
    "eps.txt": "x = {'a': 1, 'b': [2, 3]}\n" * 60,
    "zeta.txt": "while True:\n    break\n" * 55,
}
VAL_FRACTION = 0.5


@pytest.fixture
def text_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "text"
    folder.mkdir()
    for name, text in TEXTS.items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder


def prepare(capsys, *args: str) -> tuple[int, str, str]:
    status = main(["prepare", *args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def error_line(err: str) -> str:
    return err.strip().splitlines()[-1]  # after any progress bar


def nothing_written(out: Path) -> bool:
    """No --out folder, and no temporary folder left beside it."""
    return not out.exists() and not list(out.parent.glob(f".{out.name}.partial-*"))


def split_ids(folder: Path, split: str) -> np.ndarray:
    meta = read_metadata(folder)
    return np.concatenate([np.fromfile(folder / s.file, dtype=meta.token_dtype) for s in meta.shards[split]])


# ----------------------------------------------------------------------------- the folder
def test_prepared_tokens_decode_back_to_the_source_text(tmp_path: Path, text_folder: Path, capsys) -> None:
    out = tmp_path / "prepared"
    status, stdout, _ = prepare(capsys, "--out", str(out), "--path", str(text_folder), "--train-bpe",
                                "--vocab-size", "320", "--val-fraction", str(VAL_FRACTION))
    assert status == 0 and stdout.startswith(f"wrote {out}:")
    assert sorted(p.name for p in out.iterdir()) == [METADATA, "tokenizer.json", "train_000000.bin", "val_000000.bin"]
    meta = read_metadata(out)
    tokenizer = load_tokenizer(out)
    assert meta.eos_token_id == tokenizer.token_id(SEPARATOR) is not None
    assert meta.vocab_size == tokenizer.vocab_size == 320 and meta.token_dtype == "uint16"
    val = {name for name in TEXTS if _is_val_file(name, VAL_FRACTION)}
    assert val and len(val) < len(TEXTS)  # a split by file: both sides hold files
    for split, names in (("train", sorted(set(TEXTS) - val)), ("val", sorted(val))):
        ids = split_ids(out, split)
        assert len(ids) == meta.tokens(split) == json.loads((out / METADATA).read_text())["tokens"][split]
        assert ids[-1] == meta.eos_token_id and (ids == meta.eos_token_id).sum() == len(names)  # one end a document
        documents = np.split(ids, np.flatnonzero(ids == meta.eos_token_id) + 1)[:-1]
        assert [tokenizer.decode(d[:-1].tolist()) for d in documents] == [TEXTS[n] for n in names]
    assert meta.info["documents"] == {"train": len(TEXTS) - len(val), "val": len(val)}


def test_small_shards_stream_into_several_files_read_as_one(tmp_path: Path, text_folder: Path, capsys) -> None:
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    common = ["--path", str(text_folder), "--train-bpe", "--vocab-size", "300", "--val-fraction", str(VAL_FRACTION)]
    assert prepare(capsys, "--out", str(whole), *common)[0] == 0
    assert prepare(capsys, "--out", str(sharded), *common, "--shard-tokens", "100")[0] == 0
    meta = read_metadata(sharded)
    for split in ("train", "val"):
        shards = meta.shards[split]
        assert len(shards) > 1 and [s.tokens for s in shards[:-1]] == [100] * (len(shards) - 1)
        assert all((sharded / s.file).stat().st_size == 2 * s.tokens for s in shards)
        assert np.array_equal(split_ids(sharded, split), split_ids(whole, split))  # the same stream, cut
    splits = load_splits(DataConfig(source="tokens", path=str(sharded), seq_len=64, val_fraction=VAL_FRACTION))
    assert isinstance(splits.train, ShardedTokens) and splits.vocab_size == 300
    stream = torch.from_numpy(split_ids(whole, "train").astype(np.int64))
    assert splits.train.numel() == stream.numel()
    positions = torch.arange(stream.numel()).view(1, -1)  # every position: windows across every boundary
    assert torch.equal(splits.train[positions], stream.view(1, -1))
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for a, b in zip(sample_batch(splits.train, 8, 150, g1), sample_batch(stream, 8, 150, g2)):
        assert torch.equal(a, b)


def test_a_single_file_splits_by_position_at_a_line_end(tmp_path: Path) -> None:
    """Pieces of at most a few lines; the validation split starts at a line's start, near the cut."""
    path = tmp_path / "one.txt"
    lines = [f"line {i}: {'é' * (i % 7)}\n" for i in range(200)]
    path.write_text("".join(lines), encoding="utf-8")
    total = path.stat().st_size
    corpus = Corpus(tmp_path, [path], "text")
    plan = SplitPlan(None, total - total // 10)
    pieces = list(Reader(corpus, plan, piece_bytes=64).pieces())
    assert len(pieces) > 10 and all(p.text.endswith("\n") for p in pieces)
    train = "".join(p.text for p in pieces if p.split == "train")
    val = "".join(p.text for p in pieces if p.split == "val")
    assert train + val == path.read_text(encoding="utf-8")
    assert total - total // 10 <= len(train.encode()) < total - total // 10 + len(lines[-1].encode()) + 16
    assert [p.ends_document for p in pieces] == [False] * (len(pieces) - 1) + [True]


def test_max_bytes_reads_whole_lines_up_to_it(tmp_path: Path, text_folder: Path, capsys) -> None:
    out = tmp_path / "cut"
    status, _, _ = prepare(capsys, "--out", str(out), "--path", str(text_folder / "alpha.txt"), "--train-bpe",
                           "--vocab-size", "300", "--max-bytes", "500")
    assert status == 0
    meta, tokenizer = read_metadata(out), load_tokenizer(out)
    text = tokenizer.decode(np.concatenate([split_ids(out, "train"), split_ids(out, "val")]).tolist())
    assert text.endswith("\n" + SEPARATOR) and TEXTS["alpha.txt"].startswith(text.removesuffix(SEPARATOR))
    assert 400 < meta.info["bytes"] <= 500


def test_the_python_source_adds_the_installed_packages_to_the_standard_library(tmp_path: Path, capsys) -> None:
    import email.parser

    import _pytest.python

    root, files = python_files()
    assert Path(email.parser.__file__).resolve() in files  # the standard library
    assert Path(_pytest.python.__file__).resolve() in files  # an installed package
    assert files == sorted(set(files)) and all(f.is_relative_to(root) for f in files)
    assert len(files) > len(stdlib_files())
    out = tmp_path / "python"
    status, _, _ = prepare(capsys, "--out", str(out), "--source", "python", "--train-bpe", "--vocab-size", "300",
                           "--max-bytes", "200000")
    assert status == 0 and read_metadata(out).info["source"] == "python"


@pytest.mark.parametrize("vocab, dtype", [(256, "uint16"), (65536, "uint16"), (65537, "uint32"), (151_936, "uint32")])
def test_the_token_dtype_is_the_narrowest_that_holds_the_vocabulary(vocab: int, dtype: str) -> None:
    assert dtype_for(vocab) == dtype


def big_tokenizer(path: Path, size: int) -> Path:
    """A word-level tokenizer.json of `size` tokens (past uint16's range when size > 65536)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(size - 1)} | {"[UNK]": size - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


def test_a_tokenizer_past_uint16_writes_uint32_and_refuses_uint16(tmp_path: Path, capsys) -> None:
    tokenizer = big_tokenizer(tmp_path / "tokenizer.json", 70_000)
    text = tmp_path / "words.txt"
    text.write_text(" ".join(f"w{i}" for i in range(65_500, 69_999)) + "\n" + "w3 w69998 w4\n" * 50)
    out = tmp_path / "wide"
    assert prepare(capsys, "--out", str(out), "--path", str(text), "--tokenizer", str(tokenizer))[0] == 0
    meta = read_metadata(out)
    assert meta.token_dtype == "uint32" and meta.vocab_size == 70_000 and meta.eos_token_id is None
    ids = np.concatenate([split_ids(out, "train"), split_ids(out, "val")])
    assert ids.max() == 69_998 and (out / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    narrow = tmp_path / "narrow"
    status, _, err = prepare(capsys, "--out", str(narrow), "--path", str(text), "--tokenizer", str(tokenizer),
                             "--token-dtype", "uint16")
    assert status == 2 and nothing_written(narrow)
    assert error_line(err) == (f"error: --tokenizer {tokenizer}: a vocabulary of 70000 tokens does not fit "
                               "--token-dtype uint16 (ids below 65536): use uint32 or auto")


def test_a_model_folder_gives_its_tokenizer_eos_and_padded_vocabulary(tmp_path: Path, text_folder: Path, capsys) -> None:
    model = tmp_path / "hf_model"
    model.mkdir()
    big_tokenizer(model / "tokenizer.json", 1000)
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "w7"}}))
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 1024}))
    out = tmp_path / "from_model"
    assert prepare(capsys, "--out", str(out), "--path", str(text_folder), "--tokenizer", str(model))[0] == 0
    meta = read_metadata(out)
    assert meta.vocab_size == 1024 and meta.eos_token_id == 7 and meta.info["tokenizer_from"] == str(model.resolve())


# ----------------------------------------------------------------------------- bad input
BAD = {
    "missing-path": (["--path", "{tmp}/nowhere"], "error: --path: {tmp}/nowhere does not exist"),
    "empty-file": (["--path", "{tmp}/empty.txt"], "error: --path: {tmp}/empty.txt is empty: there is no text to tokenize"),
    "folder-of-empty-files": (["--path", "{tmp}/blank"], "error: --path: folder {tmp}/blank holds no non-empty files"),
    "too-small-for-a-split": (["--path", "{tmp}/tiny.txt"],
                              "error: --val-fraction 0.1: the corpus is too small to give the validation split any text; "
                              "give more text or another --val-fraction"),
    "val-fraction": (["--path", "{tmp}/tiny.txt", "--val-fraction", "1.5"],
                     "error: --val-fraction 1.5: must be between 0 and 1 (exclusive)"),
    "stdlib-with-path": (["--source", "stdlib", "--path", "{tmp}/tiny.txt"],
                         "error: --path {tmp}/tiny.txt: --source stdlib reads no path; give --source text for a file or folder"),
    "python-with-path": (["--source", "python", "--path", "{tmp}/tiny.txt"],
                         "error: --path {tmp}/tiny.txt: --source python reads no path; give --source text for a file or folder"),
    "small-vocab": (["--path", "{tmp}/tiny.txt", "--vocab-size", "200"],
                    "error: --vocab-size 200: a byte-level BPE needs more than 257 tokens (256 bytes and the document separator)"),
    "vocab-past-dtype": (["--path", "{tmp}/tiny.txt", "--vocab-size", "70000", "--token-dtype", "uint16"],
                         "error: --vocab-size 70000: a vocabulary of 70000 tokens does not fit --token-dtype uint16 "
                         "(ids below 65536): use uint32 or auto"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_one_line_naming_it_and_writes_nothing(tmp_path: Path, capsys, name: str) -> None:
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    (tmp_path / "tiny.txt").write_text("x\n")
    args, message = BAD[name]
    args = [a.format(tmp=tmp_path) for a in args]
    if "--vocab-size" not in args:
        args += ["--vocab-size", "300"]
    out = tmp_path / "out"
    status, stdout, err = prepare(capsys, "--out", str(out), "--train-bpe", *args)
    assert status == 2 and stdout == "" and nothing_written(out)
    assert error_line(err) == message.format(tmp=tmp_path)


def test_an_out_folder_holding_files_is_refused_and_left_alone(tmp_path: Path, text_folder: Path, capsys) -> None:
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.md").write_text("mine")
    status, _, err = prepare(capsys, "--out", str(out), "--path", str(text_folder), "--train-bpe", "--vocab-size", "300")
    assert status == 2 and err == f"error: --out {out}: holds other files (notes.md); give a new or empty folder\n"
    assert [p.name for p in out.iterdir()] == ["notes.md"] and not list(tmp_path.glob(".taken.partial-*"))
    (out / "notes.md").unlink()  # an empty folder is filled
    assert prepare(capsys, "--out", str(out), "--path", str(text_folder), "--train-bpe", "--vocab-size", "300")[0] == 0
    assert (out / METADATA).is_file()
    status, _, err = prepare(capsys, "--out", str(out / METADATA), "--path", str(text_folder), "--train-bpe",
                             "--vocab-size", "300")
    assert status == 2 and err == f"error: --out {out / METADATA}: is a file; give a new or empty folder\n"


@pytest.mark.parametrize("kind", ["missing", "folder-without-one", "not-a-tokenizer"])
def test_a_bad_tokenizer_names_it(tmp_path: Path, text_folder: Path, capsys, kind: str) -> None:
    path = {"missing": tmp_path / "nowhere.json", "folder-without-one": text_folder, "not-a-tokenizer": text_folder / "alpha.txt"}[kind]
    out = tmp_path / "out"
    status, _, err = prepare(capsys, "--out", str(out), "--path", str(text_folder), "--tokenizer", str(path))
    assert status == 2 and nothing_written(out)
    line = error_line(err)
    assert line.startswith(f"error: --tokenizer: {path}" if kind != "folder-without-one" else f"error: --tokenizer: folder {path}")
    assert {"missing": "does not exist", "folder-without-one": "holds no tokenizer.json",
            "not-a-tokenizer": "is not a tokenizer.json"}[kind] in line


def test_a_damaged_folder_names_the_file(tmp_path: Path, text_folder: Path, capsys) -> None:
    out = tmp_path / "prepared"
    assert prepare(capsys, "--out", str(out), "--path", str(text_folder), "--train-bpe", "--vocab-size", "300",
                   "--val-fraction", str(VAL_FRACTION))[0] == 0
    config = DataConfig(source="tokens", path=str(out), seq_len=8, val_fraction=VAL_FRACTION)
    shard = out / "val_000000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match=rf"shard {shard} has \d+ bytes, not the \d+ uint16 tokens its meta.json records"):
        load_splits(config)
    (out / METADATA).write_text("{")
    with pytest.raises(DataError, match=rf"{out / METADATA}: cannot read it as JSON"):
        load_splits(config)


# ----------------------------------------------------------------------------- config and training
@pytest.fixture(scope="module")
def small_prepared(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("text")
    for name, text in TEXTS.items():
        (folder / name).write_text(text, encoding="utf-8")
    out = folder.parent / "small_prepared"
    assert main(["prepare", "--out", str(out), "--path", str(folder), "--train-bpe", "--vocab-size", "320",
                 "--val-fraction", "0.25"]) == 0
    return out


def config_file(tmp_path: Path, data_path: Path, **model: object) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps({"model": {"d_model": 32, "n_heads": 2, "n_layers": 2, "d_ff": 64, **model},
                                "data": {"source": "tokens", "path": str(data_path), "seq_len": 16}}))
    return path


def test_the_config_takes_vocabulary_dtype_and_split_from_the_folder(tmp_path: Path, small_prepared: Path) -> None:
    config = load_config(config_file(tmp_path, small_prepared))
    assert (config.model.vocab_size, config.data.token_dtype, config.data.val_fraction) == (320, "uint16", 0.25)
    assert load_config(config_file(tmp_path, small_prepared, vocab_size=320)).model.vocab_size == 320
    with pytest.raises(ConfigError) as error:
        load_config(config_file(tmp_path, small_prepared, vocab_size=256))
    assert str(error.value) == (
        f"model.vocab_size is 256, but data.path {small_prepared} holds tokens prepared with vocab_size 320 "
        f"({small_prepared / METADATA}): leave model.vocab_size out of the config (it follows the data) or set it to 320"
    )
    with pytest.raises(ConfigError, match=r"data.token_dtype is 'uint32', but data.path .* token_dtype 'uint16'"):
        load_config(config_file(tmp_path, small_prepared), ["--data.token_dtype=uint32"])
    missing = load_config(config_file(tmp_path, tmp_path / "not_prepared_yet"))  # loads; training says what is missing
    assert missing.model.vocab_size == 256


def test_stdlib_bpe_then_a_mod_tiny_run_then_text_generation(tmp_path: Path, capsys) -> None:
    data = tmp_path / "stdlib_bpe8k"
    result = subprocess.run(
        [sys.executable, "-m", "mode.data", "prepare", "--out", str(data), "--train-bpe", "--vocab-size", "8192",
         "--max-bytes", "3000000"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    meta = read_metadata(data)
    assert meta.vocab_size == 8192 and meta.token_dtype == "uint16" and meta.info["source"] == "stdlib"
    run = tmp_path / "run"
    assert train_main([
        "--config", str(ROOT / "configs" / "mod_tiny_bpe.yaml"), f"--data.path={data}", f"--train.out_dir={run}",
        "--train.max_steps=4", "--train.batch_size=4", "--data.seq_len=64", "--train.warmup_steps=1",
        "--train.eval_interval=4", "--train.eval_batches=1", "--train.checkpoint_interval=4", "--train.progress=false",
        "--train.device=cpu",
    ]) == 0
    capsys.readouterr()
    model = load_model(run, "cpu")
    assert model.config.model.vocab_size == 8192 and model.embed.weight.shape[0] == 8192
    prompt = "def __init__(self, "
    assert generate_main(["--checkpoint", str(run), "--prompt", prompt, "--greedy", "--max-new-tokens", "12",
                          "--device", "cpu"]) == 0
    printed = capsys.readouterr().out.removesuffix("\n")
    tokenizer = load_tokenizer(data)
    ids = tokenizer.encode(prompt)
    assert tokenizer.decode(ids) == prompt and printed.startswith(prompt)
    new = generate(model, [ids], max_new_tokens=12, temperature=0)[0]
    assert len(new) == 12 and printed == tokenizer.decode(ids + new)
    assert any(t >= 256 for t in new) or any(t >= 256 for t in ids)  # BPE ids, not bytes
    assert generate(model, [prompt], max_new_tokens=12, temperature=0) == [printed[len(prompt):]]  # text in, text out


def test_a_long_line_is_read_in_pieces_that_never_split_a_character(tmp_path: Path) -> None:
    """Memory stays bounded on a file of one long line: pieces of at most 2 x piece_bytes, each valid UTF-8."""
    path = tmp_path / "line.txt"
    text = "".join(f"{i}:é世𝄞," for i in range(3000)) + "\n"
    path.write_text(text, encoding="utf-8")
    reader = Reader(Corpus(tmp_path, [path], "text"), SplitPlan(set(), 0), piece_bytes=64)
    pieces = list(reader.pieces())
    assert len(pieces) > 100 and all(p.size <= 128 for p in pieces) and not reader.not_utf8
    assert "".join(p.text for p in pieces) == text
