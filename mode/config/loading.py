"""Loading a Config: YAML (1.2 numbers, no duplicate keys), command-line overrides, error messages; saving it."""
from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml
from pydantic import ValidationError

from mode.config.config import Config
from mode.config.sections import ConfigError


def _format_errors(err: ValidationError, source: str, overrides: Sequence[str] = ()) -> str:
    """One line per error: the field path, what is wrong, the value given (a single value, not a
    whole section a cross-field check saw), and the command-line override that set it, if one did."""
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            line = f"  {path}: unknown key{_nesting_hint(e['loc'])}"
        else:
            message = e["msg"].removeprefix("Value error, ")
            # a check across sections (at the root) names its fields in its message
            line = f"  {message}" if path == "<root>" else f"  {path}: {message}"
            if not isinstance(e.get("input"), dict):
                line += f" (got {e.get('input')!r})"
        given = [o for o in overrides if _names_the_error(_override_key(o), path, line, e["type"])]
        lines.append(line + (f" [from the command line: {given[-1]}]" if given else ""))
    return "\n".join(lines)


def _nesting_hint(loc: tuple[Any, ...]) -> str:
    """A dotted key at a file's top level (`model.d_model: 64`) names a field that exists: say to nest it."""
    if len(loc) != 1 or "." not in str(loc[0]):
        return ""
    section, field = str(loc[0]).split(".", 1)
    return f" (a dotted key is not a path in a file: write it nested, {section}: {{{field}: ...}})"


def _names_the_error(key: str, path: str, line: str, kind: str) -> bool:
    """Whether the override of `key` set what an error at `path` reports: the field itself, a field the
    line names, or a field inside it (an unknown section `--trian.lr` fails as `trian`; a check of the
    section `train` names `min_lr` in its message)."""
    if key == path or key in line:
        return True
    inside = key.startswith(f"{path}.") or path == "<root>"
    return inside and (kind == "extra_forbidden" or key.rsplit(".", 1)[-1] in line)


def _override_key(text: str) -> str:
    return text.removeprefix("--").split("=", 1)[0]


def _field_path(key: str) -> list[str]:
    """'train..lr' -> ['train', 'lr']: the path a dotted key names (empty parts dropped)."""
    return [part for part in key.split(".") if part]


def override_field(text: str) -> str:
    """'--train..lr=3e-4' or 'train.lr' -> 'train.lr': the field an override (or a bare key) sets."""
    return ".".join(_field_path(_override_key(text)))


def parse_override(text: str) -> tuple[list[str], Any]:
    """'--train.lr=3e-4' -> (['train', 'lr'], 0.0003); values are parsed as YAML (load_yaml)."""
    body = text[2:] if text.startswith("--") else text
    if "=" not in body:
        raise ConfigError(f"override {text!r} must look like --section.field=value")
    key, raw = body.split("=", 1)
    path = _field_path(key)
    if len(path) < 2:
        raise ConfigError(f"override {text!r} must name a section and a field, e.g. --train.lr=3e-4")
    try:
        value = load_yaml(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML: {e}") from e
    return path, value


def apply_overrides(raw: dict[str, Any], overrides: list[str], source: str = "the config") -> dict[str, Any]:
    out = copy.deepcopy(raw)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: '{part}' in {source} is not a section (a mapping of fields)")
            node = child
        node[path[-1]] = value
    return out


def _require_mapping(raw: Any, source: str) -> None:
    if not isinstance(raw, dict):
        raise ConfigError(f"invalid config {source}: the top level must be a mapping of sections")


def config_from_dict(raw: dict[str, Any], source: str = "<dict>", overrides: Sequence[str] = ()) -> Config:
    _require_mapping(raw, source)
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source, overrides)) from None


class _StrictLoader(yaml.SafeLoader):
    """yaml.safe_load, except that a key given twice in one mapping is an error (YAML itself keeps the
    last one silently, and a second `train:` section would drop the whole first one), and that numbers
    and booleans follow YAML 1.2 (see _yaml_12_numbers) instead of PyYAML's YAML 1.1."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` merges may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (lines {seen[key]} and {line}); YAML would keep the last",
                    key_node.start_mark,
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


_INT, _FLOAT, _BOOL = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:bool"


def _yaml_12_numbers(loader: type[yaml.SafeLoader]) -> None:
    """Plain scalars become numbers and booleans by YAML 1.2's core schema, not PyYAML's YAML 1.1, whose
    rules turned written values silently into others: `seed: 010` read as 8 (octal), `1:30` as 90
    (base 60), and `1e-3` stayed text. Here an integer is decimal as written (leading zeros too), or
    0o / 0x; a float has a point or an exponent (1e-3), or is .inf / .nan; true and false are the
    booleans. Anything else is text, which the config's fields then check (`max_steps: 1:30` is an
    error naming the field). What yaml.safe_dump writes (saved runs' config.yaml) reads back the same."""
    loader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_INT, _FLOAT, _BOOL)]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    loader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
    # Integers before floats: a resolver list is tried in order, and "10" also has a float's form.
    loader.add_implicit_resolver(_INT, re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789"))
    loader.add_implicit_resolver(
        _FLOAT,
        re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
        list("-+.0123456789"),
    )
    loader.add_constructor(_INT, _construct_yaml_12_int)


def _construct_yaml_12_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    if text.startswith(("0o", "0x")):
        return int(text[2:], 8 if text[1] == "o" else 16)
    return int(text, 10)


_yaml_12_numbers(_StrictLoader)


def load_yaml(text: str) -> Any:
    """YAML text (a config file, an override's or a sweep's value) as the configs read it: _StrictLoader."""
    return yaml.load(text, Loader=_StrictLoader)


def read_yaml_file(path: Path) -> Any:
    """A YAML file's contents, strictly (_StrictLoader); unreadable text or bad YAML is a ConfigError naming it."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text ({e})") from None
    try:
        return load_yaml(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config (or the defaults when path is None) and apply --a.b=value overrides; data.path at
    a prepared token folder sets model.vocab_size, data.token_dtype and data.val_fraction (mode.data.meta)."""
    raw: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        p = Path(path)
        source = str(p)
        if p.is_dir():
            raise ConfigError(f"config file {p} is a folder; give a YAML file (see configs/)")
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        raw = read_yaml_file(p) or {}
    _require_mapping(raw, source)  # before the overrides go into it
    # A section whose keys are all commented out reads as null: an empty section, all defaults.
    raw = {name: {} if value is None else value for name, value in raw.items()}
    raw = apply_overrides(raw, overrides or [], source)
    config = config_from_dict(raw, source, overrides or [])
    from mode.data.meta import apply_metadata  # here, not above: mode.data imports this module

    apply_metadata(config)  # a prepared token folder's vocabulary, dtype and split
    return config


def flat_fields(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'model': {'d_model': 64}} -> {'model.d_model': 64}; lists stay whole values."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_fields(value, f"{name}."))
        else:
            out[name] = value
    return out


def field_differences(saved: dict[str, Any], config: Config, keep: Callable[[str], bool] = lambda name: True) -> list[str]:
    """The fields (keep(name) true) where a saved config dict and config differ, each as
    "model.d_ff (64 there, 96 here)". Fields the saved dict lacks (an older version's) are not compared."""
    there, here = flat_fields(saved), flat_fields(config.to_dict())
    return [f"{name} ({there[name]!r} there, {here.get(name)!r} here)"
            for name in there if keep(name) and there[name] != here.get(name)]


def config_text(config: Config) -> str:
    """The YAML a run folder's config.yaml holds."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False)


def save_config(config: Config, path: str | Path) -> None:
    from mode.utils import atomic_write_text

    atomic_write_text(Path(path), config_text(config))
