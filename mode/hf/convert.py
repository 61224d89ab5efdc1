"""Hugging Face folders (config.json + safetensors) to mode models and back, for the dense
families Llama, Mistral and Qwen2 and the Mixture-of-Experts families Mixtral and Qwen2-MoE
(mode/hf/moe.py); any mode model also exports as the registered `mode` type (mode/hf/auto.py).

The families share one layout: pre-norm blocks of RMSNorm, rotary attention (rotate_half on
the two halves of a head, as mode's tables), grouped-query heads, a SwiGLU MLP (or token-choice
experts of SwiGLU MLPs). Their weights map one to one onto mode's, the separate q/k/v and
gate/up projections fused. Every config feature mode cannot compute exactly is an error naming
it; nothing is dropped silently.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import Tensor

from mode.config import Config, ConfigError, RopeScaling, config_from_dict, save_config
from mode.hf.moe import (
    MOE_FAMILIES,
    MoEError,
    check_exportable,
    export_moe_layer,
    import_moe_layer,
    moe_config_kwargs,
    moe_sections,
)
from mode.model import LanguageModel
from mode.run_folder import CHECKPOINT, CONFIG, run_files_in

DENSE_FAMILIES = ("llama", "mistral", "qwen2")
IMPORTS = (*DENSE_FAMILIES, *MOE_FAMILIES)  # the model_types load_hf reads
FAMILIES = (*IMPORTS, "mode")  # what save_hf writes: mode, the registered type, holds any mode model
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
QKV_BIAS_FAMILIES = ("qwen2", "qwen2_moe")
HF_CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# Buffers older transformers versions saved with the weights: recomputed, not learned.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class HFError(ValueError):
    """A Hugging Face folder mode cannot read or write; one line naming the file or the field."""


# ----------------------------------------------------------------------------- reading a folder
def read_hf_config(folder: str | Path) -> dict[str, Any]:
    """config.json of a save_pretrained folder, checked to be a supported family."""
    folder = Path(folder)
    if not folder.is_dir():
        raise HFError(f"{folder}: not a folder (a Hugging Face model folder, written by save_pretrained)")
    path = folder / HF_CONFIG
    if not path.is_file():
        raise HFError(f"{path}: not found; {folder} is not a Hugging Face model folder (save_pretrained writes it)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFError(f"{path}: not a JSON config ({e})") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise HFError(f"{path}: holds no model_type; not a Hugging Face model config")
    if raw["model_type"] not in IMPORTS:
        raise HFError(f"{path}: model_type {raw['model_type']!r} is not supported; supported: {', '.join(IMPORTS)}")
    return raw


def read_hf_weights(folder: str | Path) -> dict[str, Tensor]:
    """Every tensor of model.safetensors, or of the shards model.safetensors.index.json lists."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    index = folder / WEIGHTS_INDEX
    if (folder / WEIGHTS).is_file():
        files = [folder / WEIGHTS]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise HFError(f"{index}: not a safetensors index (no weight_map: {e})") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        raise HFError(f"{folder / WEIGHTS}: not found (nor {WEIGHTS_INDEX}); mode reads safetensors weights "
                      "(save_pretrained writes them by default)")
    tensors: dict[str, Tensor] = {}
    for path in files:
        if not path.is_file():
            raise HFError(f"{path}: not found, and {index} lists it")
        try:
            tensors.update(load_file(path))
        except (SafetensorError, OSError) as e:
            raise HFError(f"{path}: not a readable safetensors file ({e})") from None
    return tensors


# ----------------------------------------------------------------------------- config.json -> model section
def _rope(hf: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """(rope base, scaling) from transformers 5's rope_parameters or 4's rope_theta + rope_scaling."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if any(isinstance(value, dict) for value in params.values()):
        raise HFError(f"{source}: rope_parameters differ by layer type; mode has one rotary for every layer")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise HFError(f"{source}: partial_rotary_factor {partial} is not supported (mode rotates whole heads)")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise HFError(f"{source}: rope_scaling type {kind!r} is not supported; mode has llama3 scaling or none")
    return theta, RopeScaling(
        factor=params["factor"], low_freq_factor=params["low_freq_factor"], high_freq_factor=params["high_freq_factor"],
        original_max_seq_len=params.get("original_max_position_embeddings", hf["max_position_embeddings"]),
    )


def _sliding_window_in_use(hf: dict[str, Any]) -> int | None:
    """The attention window of a Mistral model, or of a Qwen2 model's sliding layers; None without one."""
    window = hf.get("sliding_window")
    if window is None:
        return None
    if hf["model_type"] in QKV_BIAS_FAMILIES:
        layer_types = hf.get("layer_types")
        if layer_types is not None:
            return window if "sliding_attention" in layer_types else None
        sliding = hf.get("use_sliding_window", False) and hf["num_hidden_layers"] > hf.get("max_window_layers", 28)
        return window if sliding else None
    return window


def _check_representable(hf: dict[str, Any], source: str, max_seq_len: int) -> None:
    """An error naming the first config feature mode would compute differently."""
    if hf.get("hidden_act", "silu") != "silu":
        raise HFError(f"{source}: hidden_act {hf['hidden_act']!r} is not supported (mode's MLP is SwiGLU: silu)")
    if hf.get("mlp_bias", False):
        raise HFError(f"{source}: mlp_bias true is not supported (mode's MLP has no biases)")
    if hf.get("attention_bias", False):
        raise HFError(f"{source}: attention_bias true is not supported (mode has biases on q/k/v only, as qwen2)")
    if hf.get("attention_dropout", 0.0):
        raise HFError(f"{source}: attention_dropout {hf['attention_dropout']} is not supported (mode has no dropout)")
    window = _sliding_window_in_use(hf)
    if window is not None and window < max_seq_len:
        raise HFError(
            f"{source}: sliding_window {window} is in use below the context of {max_seq_len} tokens, and mode has no "
            f"sliding-window attention; import with max_seq_len <= {window} (--max-seq-len) for the exact model"
        )


def model_section(hf: dict[str, Any], source: str, max_seq_len: int | None = None) -> dict[str, Any]:
    """mode's model section (a dict) for a supported config.json; max_seq_len: the context to build
    (default the source's max_position_embeddings)."""
    try:
        heads, width = hf["num_attention_heads"], hf["hidden_size"]
        context = hf["max_position_embeddings"] if max_seq_len is None else max_seq_len
        _check_representable(hf, source, context)
        rope_base, scaling = _rope(hf, source)
        head_dim = hf.get("head_dim") or width // heads
        kv_heads = hf.get("num_key_value_heads") or heads
        pattern = moe_sections(hf)[0] if hf["model_type"] in MOE_FAMILIES else ["dense"]
        return {
            "vocab_size": hf["vocab_size"], "d_model": width, "n_heads": heads, "n_layers": hf["num_hidden_layers"],
            "d_ff": hf["intermediate_size"], "max_seq_len": context, "block_pattern": pattern,
            "n_kv_heads": None if kv_heads == heads else kv_heads,
            "head_dim": None if head_dim * heads == width else head_dim,
            "qkv_bias": hf["model_type"] == "qwen2" or (hf["model_type"] == "qwen2_moe" and hf.get("qkv_bias", True)),
            "rope_base": rope_base, "rope_scaling": None if scaling is None else scaling.model_dump(),
            "norm_eps": hf.get("rms_norm_eps", 1e-6), "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "init_std": hf.get("initializer_range", 0.02),
        }
    except KeyError as e:
        raise HFError(f"{source}: lacks {e.args[0]}, which every {hf['model_type']} config has") from None
    except MoEError as e:
        raise HFError(f"{source}: {e}") from None
    except ValueError as e:  # a RopeScaling check
        if isinstance(e, HFError):
            raise
        raise HFError(f"{source}: rope_scaling: {str(e).splitlines()[-1].strip()}") from None


def config_from_hf(hf: dict[str, Any], source: str, max_seq_len: int | None = None) -> Config:
    """A whole mode Config around model_section (and the moe section of an MoE family); the data
    section's sequences fit the context, and token ids of a large vocabulary take 32 bits."""
    model = model_section(hf, source, max_seq_len)
    data = {"seq_len": min(256, model["max_seq_len"]), "token_dtype": "uint16" if model["vocab_size"] <= 2**16 else "uint32"}
    sections = {"model": model, "data": data}
    if hf["model_type"] in MOE_FAMILIES:
        sections["moe"] = moe_sections(hf)[1]
    try:
        return config_from_dict(sections, source)
    except ConfigError as e:
        raise HFError(" ".join(str(e).split())) from None


# ----------------------------------------------------------------------------- weights
class _Weights:
    """The HF tensors, taken one by one by name; what is left at the end has no place in mode."""

    def __init__(self, tensors: dict[str, Tensor], source: str) -> None:
        self.tensors, self.source = dict(tensors), source

    def take(self, name: str) -> Tensor:
        if name not in self.tensors:
            raise HFError(f"{self.source}: lacks the weight {name}")
        return self.tensors.pop(name)

    def check_used(self) -> None:
        left = sorted(n for n in self.tensors if not n.endswith(IGNORED_SUFFIXES))
        if left:
            more = f" and {len(left) - 3} more" if len(left) > 3 else ""
            raise HFError(f"{self.source}: holds weights mode has no place for: {', '.join(left[:3])}{more}")


def mode_state(tensors: dict[str, Tensor], config: Config, family: str, source: str) -> dict[str, Tensor]:
    """The HF tensors as a LanguageModel state dict (q/k/v and gate/up fused; experts stacked)."""
    cfg = config.model
    w = _Weights(tensors, source)
    state = {"embed.weight": w.take("model.embed_tokens.weight"), "norm.weight": w.take("model.norm.weight")}
    for i, kind in enumerate(cfg.block_kinds()):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        attn = hf + "self_attn."
        state[ours + "attn_norm.weight"] = w.take(hf + "input_layernorm.weight")
        state[ours + "attn.qkv.weight"] = torch.cat([w.take(f"{attn}{p}_proj.weight") for p in "qkv"])  # (H + 2Hkv) hd rows
        if cfg.qkv_bias:
            state[ours + "attn.qkv.bias"] = torch.cat([w.take(f"{attn}{p}_proj.bias") for p in "qkv"])
        state[ours + "attn.out.weight"] = w.take(attn + "o_proj.weight")
        state[ours + "ffn_norm.weight"] = w.take(hf + "post_attention_layernorm.weight")
        if kind == "moe":
            state.update(import_moe_layer(w.take, w.tensors.__contains__, family, hf, ours + "ffn.", config.moe.n_experts))
            continue
        state[ours + "ffn.gate_up.weight"] = torch.cat([w.take(hf + "mlp.gate_proj.weight"), w.take(hf + "mlp.up_proj.weight")])
        state[ours + "ffn.down.weight"] = w.take(hf + "mlp.down_proj.weight")
    if cfg.tie_embeddings:
        w.tensors.pop("lm_head.weight", None)  # a tied copy, where a writer saved one
        state["lm_head.weight"] = state["embed.weight"]
    else:
        state["lm_head.weight"] = w.take("lm_head.weight")
    w.check_used()
    return state


def hf_state(model: LanguageModel, family: str = "llama") -> dict[str, Tensor]:
    """A dense or MoE LanguageModel's weights under the family's names (q/k/v and gate/up split,
    experts one by one); q/k/v biases where the model has them. Tied: the embedding alone, as
    save_pretrained."""
    cfg = model.config.model
    ours = {name: t.detach() for name, t in model.state_dict().items()}
    hd = cfg.head_width
    split = (cfg.n_heads * hd, cfg.kv_heads * hd, cfg.kv_heads * hd)
    state = {"model.embed_tokens.weight": ours["embed.weight"], "model.norm.weight": ours["norm.weight"]}
    for i, kind in enumerate(cfg.block_kinds()):
        hf, b = f"model.layers.{i}.", f"blocks.{i}."
        attn = hf + "self_attn."
        state[hf + "input_layernorm.weight"] = ours[b + "attn_norm.weight"]
        for p, t in zip("qkv", ours[b + "attn.qkv.weight"].split(split)):
            state[f"{attn}{p}_proj.weight"] = t
        if cfg.qkv_bias:
            for p, t in zip("qkv", ours[b + "attn.qkv.bias"].split(split)):
                state[f"{attn}{p}_proj.bias"] = t
        state[attn + "o_proj.weight"] = ours[b + "attn.out.weight"]
        state[hf + "post_attention_layernorm.weight"] = ours[b + "ffn_norm.weight"]
        if kind == "moe":
            state.update(export_moe_layer(ours, family, hf, b + "ffn.", model.config))
            continue
        gate, up = ours[b + "ffn.gate_up.weight"].chunk(2)
        state[hf + "mlp.gate_proj.weight"], state[hf + "mlp.up_proj.weight"] = gate, up
        state[hf + "mlp.down_proj.weight"] = ours[b + "ffn.down.weight"]
    if not cfg.tie_embeddings:
        state["lm_head.weight"] = ours["lm_head.weight"]
    return {name: t.contiguous().clone() for name, t in state.items()}  # safetensors wants owned, unshared tensors


# ----------------------------------------------------------------------------- load / save
def load_hf(folder: str | Path, max_seq_len: int | None = None) -> tuple[Config, LanguageModel]:
    """(Config, LanguageModel in eval mode, float32) of a save_pretrained folder of LlamaForCausalLM,
    MistralForCausalLM, Qwen2ForCausalLM, MixtralForCausalLM or Qwen2MoeForCausalLM. max_seq_len: the context to build (default the
    source's max_position_embeddings; a smaller one makes smaller rotary tables)."""
    folder = Path(folder)
    hf = read_hf_config(folder)
    source = str(folder / HF_CONFIG)
    config = config_from_hf(hf, source, max_seq_len)
    tensors = read_hf_weights(folder)
    state = mode_state(tensors, config, hf["model_type"], str(folder))
    model = LanguageModel(config)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:  # a weight of another shape than config.json describes
        first = str(e).strip().splitlines()[-1].strip()
        raise HFError(f"{folder}: its weights do not fit its {HF_CONFIG} ({first})") from None
    return config, model.eval()


def hf_config(model: LanguageModel, family: str):
    """The transformers config (LlamaConfig, MistralConfig, Qwen2Config, MixtralConfig or
    Qwen2MoeConfig) of a dense or MoE mode model."""
    import transformers

    config = model.config
    cfg = config.model
    if family not in IMPORTS:
        raise HFError(f"family {family!r} is not supported; supported: {', '.join(FAMILIES)}")
    if family in MOE_FAMILIES:
        try:
            check_exportable(config, family)
        except MoEError as e:
            raise HFError(str(e)) from None
    elif sorted(set(cfg.block_kinds())) != ["dense"]:
        raise HFError(f"model.block_pattern {cfg.block_pattern}: only dense models export to family {family} "
                      "(MoE models: mixtral, qwen2_moe; MoD and MoDE models: the registered type, family mode)")
    if cfg.qkv_bias and family not in QKV_BIAS_FAMILIES:
        raise HFError(f"model.qkv_bias true: family {family} has no q/k/v biases; export as family qwen2")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_base}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope.update(rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq_factor,
                    high_freq_factor=s.high_freq_factor, original_max_position_embeddings=s.original_max_seq_len)
    kwargs = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_width,
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std, hidden_act="silu", rope_parameters=rope, bos_token_id=None,
        eos_token_id=None, architectures=[ARCHITECTURES[family]], dtype=str(model.embed.weight.dtype).removeprefix("torch."),
    )
    if family == "mistral":
        kwargs["sliding_window"] = None
    if family == "qwen2":
        kwargs.update(use_sliding_window=False, sliding_window=None)
    if family in MOE_FAMILIES:
        kwargs.update(moe_config_kwargs(config, family))
    classes = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config,
               "mixtral": transformers.MixtralConfig, "qwen2_moe": transformers.Qwen2MoeConfig}
    return classes[family](**kwargs)


def save_hf(model: LanguageModel, cfg: Config | None, folder: str | Path, family: str = "llama") -> None:
    """Write a mode model as a Hugging Face folder (config.json + model.safetensors) that
    transformers.AutoModelForCausalLM.from_pretrained loads as `family`: a dense one as llama,
    mistral or qwen2, an MoE one as mixtral or qwen2_moe, any one as mode (the type `import mode.hf`
    registers). cfg: the model's Config (None: model.config). The folder is new or empty; it
    appears whole (written beside, then renamed)."""
    from safetensors.torch import save_file

    if cfg is not None and cfg.model != model.config.model:
        raise HFError("save_hf: cfg's model section is not the model's (give model.config, or None)")
    if family == "mode":
        from mode.hf.auto import save_mode

        with staged_folder(Path(folder)) as tmp:
            save_mode(model, tmp)
        return
    config = hf_config(model, family)
    state = hf_state(model, family)
    if family == "qwen2" and not model.config.model.qkv_bias:  # qwen2 always has q/k/v biases: zero ones compute the same
        for name in [n for n in state if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))]:
            state[name.removesuffix("weight") + "bias"] = state[name].new_zeros(state[name].shape[0])
    with staged_folder(Path(folder)) as tmp:
        (tmp / HF_CONFIG).write_text(config.to_json_string(use_diff=False), encoding="utf-8")
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})


# ----------------------------------------------------------------------------- run folders
def import_run(hf_folder: str | Path, run_folder: str | Path, max_seq_len: int | None = None) -> Config:
    """A mode run folder (config.yaml + checkpoint.pt at step 0) holding a Hugging Face model:
    mode.generate, mode.evaluate and mode.train --train.init_from read it."""
    config, model = load_hf(hf_folder, max_seq_len)
    run_folder = Path(run_folder)
    config.train.out_dir = str(run_folder)
    payload = {
        "format": "mode-checkpoint-v1", "config": config.to_dict(), "state": {"step": 0, "tokens": 0, "flops": 0.0},
        "rng": torch.get_rng_state(), "cuda_rng": None, "cuda_rng_run": None, "model": model.state_dict(),
        "source": {"hf_folder": str(hf_folder)},
    }
    with staged_folder(run_folder) as tmp:
        save_config(config, tmp / CONFIG)
        torch.save(payload, tmp / CHECKPOINT)
    return config


def export_run(run_folder: str | Path, hf_folder: str | Path, family: str = "llama") -> None:
    """save_hf of the model a run folder (or checkpoint.pt) holds."""
    from mode.checkpoint import load_model

    model = load_model(run_folder)
    save_hf(model, None, hf_folder, family)


@contextlib.contextmanager
def staged_folder(target: Path) -> Iterator[Path]:
    """A temporary folder beside `target` to write into, renamed to `target` when the block ends
    without an error and removed when it does not: the folder appears whole or not at all.
    target must not exist, or be an empty folder."""
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        held = f" (it holds {', '.join(run_files_in(target))})" if target.is_dir() and run_files_in(target) else ""
        raise HFError(f"{target}: exists and is not an empty folder{held}; give a new folder")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))
    try:
        yield tmp
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o777 & ~mask)  # mkdtemp's folder is its owner's alone
        if target.exists():
            target.rmdir()
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
