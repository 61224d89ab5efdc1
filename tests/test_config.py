"""Config: strict validation that names the field and the file, overrides, save/load round trip."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mode.config import (
    Config,
    ConfigError,
    config_from_dict,
    load_config,
    parse_override,
    save_config,
)

# A small valid config; each test below breaks one field of it.
BASE: dict = {
    "model": {"d_model": 32, "n_heads": 2, "n_layers": 2, "d_ff": 64, "max_seq_len": 64,
              "block_pattern": ["dense", "mod"]},
    "routing": {"capacity": 0.25},
    "data": {"source": "stdlib", "seq_len": 32},
    "train": {"batch_size": 4, "max_steps": 10, "lr": 1e-3, "min_lr": 1e-4, "progress": False},
}


def _set(path: str, value) -> dict:
    import copy

    raw = copy.deepcopy(BASE)
    node = raw
    *parents, leaf = path.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return raw


def _write(tmp_path: Path, raw: dict, name: str = "experiment.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _load_error(tmp_path: Path, raw: dict, name: str = "experiment.yaml") -> str:
    path = _write(tmp_path, raw, name)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return str(info.value)


def test_base_config_is_valid(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, BASE))
    assert cfg.model.d_model == 32 and cfg.model.block_kinds() == ["dense", "mod"]


# ----------------------------------------------------------------------------- unknown keys
@pytest.mark.parametrize(
    "path",
    ["model.n_layer", "routing.capacityy", "train.learning_rate", "data.sequence_length", "modle"],
)
def test_unknown_key_names_dotted_path_and_file(tmp_path: Path, path: str) -> None:
    name = "typo_experiment.yaml"
    msg = _load_error(tmp_path, _set(path, 4), name)
    assert path in msg, msg
    assert name in msg, msg
    assert "unknown key" in msg


def test_unknown_key_in_override_names_path() -> None:
    with pytest.raises(ConfigError, match=r"train\.lrr"):
        load_config(None, ["--train.lrr=0.1"])


# ----------------------------------------------------------------------------- wrong types
@pytest.mark.parametrize(
    "path, value",
    [
        ("model.d_model", "wide"),
        ("model.d_model", 12.5),  # not a whole number
        ("model.block_pattern", "dense"),  # a string, not a list
        ("train.lr", "fast"),
        ("train.progress", "maybe"),
        ("routing.gate", "tanh"),
        ("data.source", "internet"),
        ("model.n_layers", True),  # YAML's true/yes is a boolean, never the number 1
        ("train.lr", True),
        ("train.seed", False),
    ],
)
def test_wrong_type_names_field(tmp_path: Path, path: str, value) -> None:
    msg = _load_error(tmp_path, _set(path, value))
    assert path in msg, msg
    assert "experiment.yaml" in msg


def test_section_that_is_not_a_mapping(tmp_path: Path) -> None:
    msg = _load_error(tmp_path, _set("model", 5))
    assert "model" in msg


def test_top_level_not_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- model\n- train\n")
    with pytest.raises(ConfigError, match="list.yaml"):
        load_config(path)


# ----------------------------------------------------------------------------- impossible values
@pytest.mark.parametrize(
    "path, value, field_named",
    [
        ("routing.capacity", 0, "routing.capacity"),
        ("routing.capacity", 1.5, "routing.capacity"),
        ("routing.capacity", -0.1, "routing.capacity"),
        ("model.n_heads", 3, "n_heads"),  # 32 % 3 != 0
        ("model.block_pattern", ["dense", "modd"], "model.block_pattern"),
        ("data.seq_len", 128, "data.seq_len"),  # > model.max_seq_len 64
        ("train.min_lr", 1e-2, "min_lr"),  # > lr 1e-3
        ("data.val_fraction", 1.0, "data.val_fraction"),
        ("train.batch_size", 0, "train.batch_size"),
    ],
)
def test_impossible_value_names_field(tmp_path: Path, path: str, value, field_named: str) -> None:
    msg = _load_error(tmp_path, _set(path, value))
    assert field_named in msg, msg
    assert "experiment.yaml" in msg


def test_width_not_divisible_by_heads_names_both(tmp_path: Path) -> None:
    msg = _load_error(tmp_path, _set("model.n_heads", 3))
    assert "d_model" in msg and "n_heads" in msg and "model" in msg


def test_block_kind_that_does_not_exist_names_it(tmp_path: Path) -> None:
    msg = _load_error(tmp_path, _set("model.block_pattern", ["dense", "mixture_of_depth"]))
    assert "model.block_pattern" in msg and "mixture_of_depth" in msg


def test_seq_len_beyond_max_seq_len_names_both(tmp_path: Path) -> None:
    msg = _load_error(tmp_path, _set("data.seq_len", 128))
    assert "data.seq_len" in msg and "model.max_seq_len" in msg


def test_expert_choice_group_that_does_not_divide_the_batch_names_both(tmp_path: Path) -> None:
    raw = _set("model.block_pattern", ["dense", "moe"])
    raw["moe"] = {"group_size": 3}  # batch_size 4
    msg = _load_error(tmp_path, raw)
    assert "moe.group_size (3) must divide train.batch_size (4)" in msg and "experiment.yaml" in msg
    raw["model"]["block_pattern"] = ["dense", "mod"]  # no experts, nothing to group
    load_config(_write(tmp_path, raw))


def test_a_group_size_under_token_choice_is_an_error(tmp_path: Path) -> None:
    """Token choice routes each token on its own (a capacity spans the micro-batch): a group size
    there would be ignored, so it is refused, as top_k is under expert choice."""
    raw = _set("model.block_pattern", ["dense", "moe"])
    raw["moe"] = {"scheme": "token_choice", "group_size": 2}  # divides batch_size 4
    msg = _load_error(tmp_path, raw)
    assert "group_size applies to scheme expert_choice only" in msg and "experiment.yaml" in msg
    raw["moe"]["group_size"] = 1
    load_config(_write(tmp_path, raw))


def test_errors_name_the_override_and_never_dump_a_section(tmp_path: Path) -> None:
    path = _write(tmp_path, BASE)
    with pytest.raises(ConfigError) as info:
        load_config(path, ["--train.lr=abc", "--model.n_heads=3"])
    msg = str(info.value)
    assert "train.lr:" in msg and "[from the command line: --train.lr=abc]" in msg
    assert "must be divisible by n_heads (3)" in msg
    assert "vocab_size" not in msg  # the model section a cross-field check saw is not printed
    msg = _load_error(tmp_path, _set("train.lr", "abc"))
    assert "from the command line" not in msg  # the file set it


def test_path_with_the_stdlib_source_is_an_error(tmp_path: Path) -> None:
    msg = _load_error(tmp_path, _set("data.path", "/some/corpus.txt"))
    assert "data.path (/some/corpus.txt) is set but data.source is 'stdlib'" in msg


def test_top_level_list_with_overrides_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- model\n- train\n")
    with pytest.raises(ConfigError, match="list.yaml: the top level must be a mapping"):
        load_config(path, ["--train.max_steps=1"])


@pytest.mark.parametrize("source", ["text", "tokens"])
def test_source_without_path_names_data_path(tmp_path: Path, source: str) -> None:
    msg = _load_error(tmp_path, _set("data.source", source))
    assert "data.path" in msg, msg


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nowhere.yaml"):
        load_config(tmp_path / "nowhere.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {d_model: 32\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(bad)


# ----------------------------------------------------------------------------- overrides
def test_overrides_apply_with_yaml_types(tmp_path: Path) -> None:
    path = _write(tmp_path, BASE)
    cfg = load_config(
        path,
        ["--train.lr=3e-4", "--model.block_pattern=[dense,mod]", "--model.n_layers=4",
         "--routing.random=true", "--train.min_lr=0", "--data.source=text", "--data.path=/some/where"],
    )
    assert cfg.train.lr == 3e-4 and isinstance(cfg.train.lr, float)
    assert cfg.model.block_pattern == ["dense", "mod"]
    assert cfg.model.n_layers == 4 and cfg.model.block_kinds() == ["dense", "mod", "dense", "mod"]
    assert cfg.routing.random is True
    assert cfg.data.path == "/some/where"
    # Overrides replace only what they name: the file's other values stay.
    assert cfg.model.d_model == 32 and cfg.train.batch_size == 4


def test_override_is_validated_like_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, BASE)
    with pytest.raises(ConfigError) as info:
        load_config(path, ["--routing.capacity=1.5"])
    assert "routing.capacity" in str(info.value) and "experiment.yaml" in str(info.value)


def test_parse_override() -> None:
    assert parse_override("--train.lr=3e-4") == (["train", "lr"], 3e-4)  # YAML 1.2: a float (1.1 kept text)
    assert parse_override("--model.block_pattern=[dense, mod]") == (["model", "block_pattern"], ["dense", "mod"])
    assert parse_override("--train.out_dir=") == (["train", "out_dir"], "")


def test_numbers_read_as_written_in_files_and_overrides(tmp_path: Path) -> None:
    """YAML 1.2 numbers (mode.config.load_yaml): PyYAML's YAML 1.1 read `seed: 010` as 8 (octal) and
    `1:30` as 90 (base 60), silently; here 010 is ten, in a file and an override alike, 0x / 0o are
    explicit, and a value that is no number is an error naming its field."""
    path = _write(tmp_path, BASE)
    path.write_text(path.read_text().replace("train:\n", "train:\n  seed: 010\n  log_interval: 0x10\n", 1))
    cfg = load_config(path)
    assert cfg.train.seed == 10 and cfg.train.log_interval == 16
    cfg = load_config(path, ["--train.seed=007", "--train.lr=1e-3", "--train.max_steps=0o17"])
    assert cfg.train.seed == 7 and cfg.train.lr == 1e-3 and cfg.train.max_steps == 15
    with pytest.raises(ConfigError) as info:
        load_config(path, ["--train.max_steps=1:30"])
    assert "train.max_steps" in str(info.value)
    assert load_config(path, ["--train.compile=false"]).train.compile is False


def test_a_saved_config_reads_back_equal(tmp_path: Path) -> None:
    """What save_config writes (yaml.safe_dump) reads back through load_yaml as the same config: floats
    in exponent form, strings YAML 1.1 would take for numbers or booleans (safe_dump quotes them)."""
    from mode.config import save_config

    cfg = load_config(_write(tmp_path, BASE), ["--train.lr=6e-05", "--train.min_lr=0.0", "--train.out_dir='010'"])
    save_config(cfg, tmp_path / "saved.yaml")
    again = load_config(tmp_path / "saved.yaml")
    assert again == cfg and again.train.out_dir == "010" and again.train.lr == 6e-05


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("--train.lr", "--section.field=value"),  # no '='
        ("--lr=3e-4", "section and a field"),  # no section
        ("--model.block_pattern=[dense, mod", "not valid YAML"),
        ("--model.d_model.x=1", "not a section"),  # d_model is a value in the file, not a section
    ],
)
def test_malformed_override_is_clear_error(tmp_path: Path, override: str, fragment: str) -> None:
    path = _write(tmp_path, BASE)
    with pytest.raises(ConfigError) as info:
        load_config(path, [override])
    assert fragment in str(info.value), str(info.value)


# ----------------------------------------------------------------------------- save / load
def test_save_then_load_round_trips(tmp_path: Path) -> None:
    cfg = config_from_dict(
        _set("routing.gate", "identity")
        | {"data": {"source": "text", "path": str(tmp_path / "corpus"), "seq_len": 32, "val_fraction": 0.2}}
    )
    cfg.train.min_lr = 3e-5  # a float YAML writes in exponent form
    cfg.model.norm_eps = 1e-5
    out = tmp_path / "saved" / "config.yaml"
    save_config(cfg, out)
    loaded = load_config(out)
    assert loaded == cfg
    assert loaded.to_dict() == cfg.to_dict()
    # And again: saving what was loaded writes the same text.
    again = tmp_path / "again.yaml"
    save_config(loaded, again)
    assert again.read_text() == out.read_text()


def test_defaults_round_trip(tmp_path: Path) -> None:
    cfg = Config()
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg



# ----------------------------------------------------------------------------- audit
def test_a_key_given_twice_is_an_error_naming_both_lines(tmp_path: Path) -> None:
    """YAML keeps the last of two equal keys without a word: a second `train:` section would drop the first."""
    twice = tmp_path / "twice.yaml"
    twice.write_text("train:\n  lr: 0.001\n  max_steps: 3\nmodel:\n  d_model: 32\ntrain:\n  batch_size: 2\n")
    with pytest.raises(ConfigError, match=r"twice\.yaml.*key 'train' is given twice \(lines 1 and 6\)"):
        load_config(twice)
    field = tmp_path / "field.yaml"
    field.write_text("train:\n  max_steps: 3\n  max_steps: 5\n")
    with pytest.raises(ConfigError, match=r"key 'max_steps' is given twice \(lines 2 and 3\)"):
        load_config(field)
    merged = tmp_path / "merged.yaml"  # a YAML merge overridden by an explicit key is not a duplicate
    merged.write_text("train:\n  <<: {lr: 0.001, max_steps: 3}\n  max_steps: 5\n")
    assert load_config(merged).train.max_steps == 5 and load_config(merged).train.lr == 0.001


def test_infinite_and_nan_numbers_are_refused(tmp_path: Path) -> None:
    for override in ("--train.lr=.inf", "--model.rope_base=.inf", "--train.grad_clip=.nan"):
        with pytest.raises(ConfigError, match=override.split("=")[0].removeprefix("--")):
            load_config(_write(tmp_path, BASE), [override])


def test_an_empty_section_is_all_defaults_and_takes_overrides(tmp_path: Path) -> None:
    path = tmp_path / "empty_section.yaml"
    path.write_text("model:\n  # d_model: 64\ntrain:\n  max_steps: 7\n")
    config = load_config(path, ["--model.n_layers=3"])
    assert config.model.n_layers == 3 and config.model.d_model == Config().model.d_model
    assert config.train.max_steps == 7


def test_a_folder_or_non_utf8_file_names_itself(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=rf"{tmp_path} is a folder"):
        load_config(tmp_path)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"train:\n  out_dir: caf\xe9\n")
    with pytest.raises(ConfigError, match=r"latin\.yaml is not UTF-8"):
        load_config(latin)


@pytest.mark.parametrize("override, line", [
    ("--trian.lr=1", "trian: unknown key [from the command line: --trian.lr=1]"),
    ("--train.min_lr=0.5", "must not exceed lr (0.001) [from the command line: --train.min_lr=0.5]"),
    ("--model.d_model=31", "divisible by n_heads (2) [from the command line: --model.d_model=31]"),
])
def test_errors_of_a_section_or_an_unknown_one_name_the_override(tmp_path: Path, override: str, line: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, BASE), [override, "--train.batch_size=4"])
    assert line in str(info.value) and "batch_size=4]" not in str(info.value)


# ----------------------------------------------------------------------------- paths, seeds, and settings that would be ignored
def _override_error(tmp_path: Path, overrides: list[str], raw: dict | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, raw or BASE), overrides)
    return str(info.value)


@pytest.mark.parametrize("field", ["out_dir", "init_from"])
def test_an_empty_run_folder_or_init_checkpoint_is_refused(tmp_path: Path, field: str) -> None:
    """An empty path is the current folder (`--train.out_dir=$OUT` with OUT unset): refused, naming the field."""
    error = _override_error(tmp_path, [f"--train.{field}="])
    assert f"train.{field}: String should have at least 1 character (got '')" in error, error
    assert f"{tmp_path / 'experiment.yaml'}" in error


def test_a_pattern_longer_than_n_layers_is_refused(tmp_path: Path) -> None:
    """The kinds past n_layers would never be built, while moe / routing and config.yaml still describe them."""
    error = _override_error(tmp_path, ["--model.n_layers=1", "--moe.n_noop=4"],
                            _set("model.block_pattern", ["dense", "mode_integrated"]))
    assert "model: block_pattern has 2 kinds ['dense', 'mode_integrated'] but n_layers is 1" in error, error
    assert "[from the command line: --model.n_layers=1]" in error
    # The default pattern [dense, mod] is cut to [dense] as before: a run's saved config gives it too.
    assert config_from_dict({"model": {"n_layers": 1}}).model.block_kinds() == ["dense"]
    assert config_from_dict({"model": {"n_layers": 1, "block_pattern": ["dense", "mod"]}}).model.n_layers == 1


def test_has_experts_reads_the_blocks_built() -> None:
    """has_experts (expert_parallel, group_size, cuda_graphs checks) and has_depth_router look at
    block_kinds(), not at the pattern (model_construct: a pattern the validator would now refuse)."""
    from mode.config import ModelConfig

    cut = ModelConfig.model_construct(block_pattern=["dense", "moe"], n_layers=1)
    assert cut.block_kinds() == ["dense"] and not cut.has_experts() and not cut.has_depth_router()
    whole = ModelConfig(block_pattern=["mode_staged"], n_layers=1)
    assert whole.has_experts() and whole.has_depth_router()


@pytest.mark.parametrize("seed", ["99999999999999999999", str(2**63), "-1"])
def test_a_seed_out_of_range_names_train_seed(tmp_path: Path, seed: str) -> None:
    """torch.manual_seed failed past 64 bits with "Overflow when unpacking long long", naming no field."""
    error = _override_error(tmp_path, [f"--train.seed={seed}"])
    assert f"train.seed: must be between 0 and 2**63 - 1 (got {seed})" in error, error
    assert load_config(_write(tmp_path, BASE), [f"--train.seed={2**63 - 1}"]).train.seed == 2**63 - 1


def test_moe_fields_the_scheme_ignores_are_refused(tmp_path: Path) -> None:
    """Dropless token choice has no capacity; expert choice adds no load-balancing loss. A value other
    than the default is refused, naming both fields; the default, as a saved config.yaml gives it, is not."""
    raw = _set("model.block_pattern", ["dense", "moe"])
    token_choice = ["--moe.scheme=token_choice", "--moe.dropless=true"]
    error = _override_error(tmp_path, [*token_choice, "--moe.capacity_factor=2.0"], raw)
    assert "moe: capacity_factor (2.0) has no effect with dropless=true" in error, error
    assert "[from the command line: --moe.capacity_factor=2.0]" in error
    assert load_config(_write(tmp_path, raw), [*token_choice, "--moe.capacity_factor=1.0"]).moe.dropless
    error = _override_error(tmp_path, ["--moe.lb_loss_weight=0.5"], raw)
    assert "moe: lb_loss_weight (0.5) applies to scheme token_choice only" in error, error
    saved = load_config(_write(tmp_path, raw)).to_dict()  # every field given, at its default
    assert config_from_dict(saved).moe.lb_loss_weight == 0.01


@pytest.mark.parametrize("pattern", [["dense"], ["dense", "moe"], ["dense", "mode_integrated"]])
def test_random_routing_without_a_depth_router_is_refused(tmp_path: Path, pattern: list[str]) -> None:
    """routing.random replaces depth routers' scores only: a model with no mod or mode_staged block
    trained as learned routing, and the ablation compared two equal runs."""
    raw = _set("model.block_pattern", pattern)
    raw["moe"] = {"n_noop": 4}
    error = _override_error(tmp_path, ["--routing.random=true"], raw)
    assert "routing.random=true changes only depth routers' choices (mod and mode_staged blocks)" in error, error
    assert "[from the command line: --routing.random=true]" in error
    for routed in (["dense", "mod"], ["dense", "mode_staged"]):
        assert load_config(_write(tmp_path, _set("model.block_pattern", routed)), ["--routing.random=true"]).routing.random


@pytest.mark.parametrize("causal", ["aux_loss", "predictor"])
def test_random_routing_with_a_causal_decision_is_refused(tmp_path: Path, causal: str) -> None:
    """The causal BCE would learn towards random top-k membership, and the model cannot be sampled."""
    error = _override_error(tmp_path, ["--routing.random=true", f"--routing.causal={causal}"])
    assert f"routing.random=true with routing.causal={causal}" in error and "set routing.causal=none" in error, error


def test_a_dotted_top_level_key_or_a_scalar_section_names_the_fix_and_the_file(tmp_path: Path) -> None:
    """`model.d_model: 64` at a file's top level was "unknown key", though the field exists; a section
    given as a scalar, with an override into it, named neither the file nor what was wrong."""
    dotted = tmp_path / "dotted.yaml"
    dotted.write_text("model.d_model: 64\n")
    with pytest.raises(ConfigError) as info:
        load_config(dotted)
    assert "model.d_model: unknown key (a dotted key is not a path in a file: write it nested, model: {d_model: ...})" \
        in str(info.value), str(info.value)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("model: 5\n")
    with pytest.raises(ConfigError, match=rf"'model' in {scalar} is not a section \(a mapping of fields\)"):
        load_config(scalar, ["--model.d_model=64"])
