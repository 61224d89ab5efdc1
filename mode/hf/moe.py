"""The Mixture-of-Experts families Mixtral and Qwen2-MoE, mapped onto mode's token-choice MoE.

Both route as mode's token choice without no-op slots: router logits x W^T (W (E, D), no bias),
a softmax over the E experts, each token's top-k, every assignment computed (dropless). Mixtral
divides the k probabilities by their sum (moe.renormalize); Qwen2-MoE does where norm_topk_prob
is set, and adds a shared SwiGLU expert scaled by sigmoid(x W_g) (moe.shared_expert_d,
moe.shared_expert_gate). Qwen2-MoE's layers are MoE or dense by decoder_sparse_step and
mlp_only_layers: model.block_pattern lists every layer's kind. Experts: mode's w_in (E, D, 2F) =
[gate | up] and w_out (E, F, D) hold the transposes of the families' per-expert Linear weights.

Training-only coefficients: router_aux_loss_coef becomes moe.lb_loss_weight (both families add the
Switch load-balancing loss mode computes); neither family has a router z-loss (moe.z_loss_weight 0).
Router jitter (Mixtral's router_jitter_noise, training only) mode does not have: an error.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from mode.config import Config

MOE_FAMILIES = ("mixtral", "qwen2_moe")
EXPERTS = {"mixtral": "block_sparse_moe", "qwen2_moe": "mlp"}  # the MoE module's name in a layer
# Each family's per-expert Linear names: (gate, up, down).
EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj")}


class MoEError(ValueError):
    """A Mixture-of-Experts config or weight mode cannot represent (the caller adds the source)."""


# ----------------------------------------------------------------------------- config.json -> mode
def layer_kinds(hf: dict[str, Any]) -> list[str]:
    """Each layer's mode kind, "moe" or "dense", as the family builds them."""
    layers = hf["num_hidden_layers"]
    if hf["model_type"] == "mixtral":
        return ["moe"] * layers
    only_mlp = set(hf.get("mlp_only_layers") or [])
    step, experts = hf.get("decoder_sparse_step", 1), hf["num_experts"]
    return ["moe" if i not in only_mlp and experts > 0 and (i + 1) % step == 0 else "dense" for i in range(layers)]


def moe_sections(hf: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """(model.block_pattern, the moe section) of a Mixtral or Qwen2-MoE config.json."""
    kinds = layer_kinds(hf)
    pattern = kinds[:1] if len(set(kinds)) == 1 else kinds
    if "moe" not in kinds:
        return pattern, {}
    if hf.get("router_jitter_noise", 0.0):
        raise MoEError(f"router_jitter_noise {hf['router_jitter_noise']} is not supported (mode's routers have no "
                       "jitter); set it to 0.0")
    moe: dict[str, Any] = {"scheme": "token_choice", "dropless": True, "n_noop": 0, "activation": "swiglu",
                           "top_k": hf["num_experts_per_tok"], "lb_loss_weight": hf.get("router_aux_loss_coef", 0.0),
                           "z_loss_weight": 0.0}
    if hf["model_type"] == "mixtral":
        moe.update(n_experts=hf["num_local_experts"], renormalize=True)
        return pattern, moe
    shared = hf.get("shared_expert_intermediate_size", 0)
    if not shared:
        raise MoEError("shared_expert_intermediate_size 0 is not supported (Qwen2-MoE's shared expert needs a width)")
    moe.update(n_experts=hf["num_experts"], renormalize=bool(hf.get("norm_topk_prob", False)),
               d_expert=hf["moe_intermediate_size"], shared_expert_d=shared, shared_expert_gate=True)
    return pattern, moe


def import_moe_layer(take: Callable[[str], Tensor], has: Callable[[str], bool], family: str, layer: str,
                   ours: str, n_experts: int) -> dict[str, Tensor]:
    """mode's tensors of one MoE layer's FFN (prefix ours, e.g. "blocks.0.ffn.") from the HF layer
    `layer` (e.g. "model.layers.0."): per-expert Linear weights as save_pretrained writes them,
    or the fused gate_up_proj (E, 2F, D) / down_proj (E, D, F) of transformers' modules (which
    name Mixtral's MoE module mlp)."""
    hf = f"{layer}{EXPERTS[family]}."
    if not has(hf + "gate.weight") and has(f"{layer}mlp.gate.weight"):
        hf = f"{layer}mlp."
    state = {ours + "router.router.proj.weight": take(hf + "gate.weight")}  # (E, D)
    if has(hf + "experts.gate_up_proj"):
        state[ours + "experts.w_in"] = take(hf + "experts.gate_up_proj").transpose(1, 2)  # (E, D, 2F)
        state[ours + "experts.w_out"] = take(hf + "experts.down_proj").transpose(1, 2)  # (E, F, D)
    else:
        gate, up, down = EXPERT_NAMES[family]
        ex = [f"{hf}experts.{e}." for e in range(n_experts)]
        state[ours + "experts.w_in"] = torch.stack(
            [torch.cat([take(f"{p}{gate}.weight"), take(f"{p}{up}.weight")]).t() for p in ex])  # (E, D, 2F)
        state[ours + "experts.w_out"] = torch.stack([take(f"{p}{down}.weight").t() for p in ex])  # (E, F, D)
    if family == "qwen2_moe":
        state[ours + "shared_expert.gate_up.weight"] = torch.cat(
            [take(hf + "shared_expert.gate_proj.weight"), take(hf + "shared_expert.up_proj.weight")])  # (2S, D)
        state[ours + "shared_expert.down.weight"] = take(hf + "shared_expert.down_proj.weight")
        state[ours + "shared_expert_gate.weight"] = take(hf + "shared_expert_gate.weight")  # (1, D)
    return state


# ----------------------------------------------------------------------------- mode -> config.json
def check_exportable(config: Config, family: str) -> None:
    """An error naming the first field of a mode model that `family` cannot hold."""
    m, moe = config.model, config.moe
    kinds = m.block_kinds()
    if family == "mixtral" and set(kinds) != {"moe"}:
        raise MoEError(f"model.block_pattern {m.block_pattern}: family mixtral has an MoE FFN in every layer; "
                       "export as family qwen2_moe (which has dense layers too)")
    if not set(kinds) <= {"moe", "dense"}:
        raise MoEError(f"model.block_pattern {m.block_pattern}: family {family} holds moe and dense blocks only "
                       "(no Hugging Face architecture holds MoD or MoDE blocks); export as family mode")
    if m.qkv_bias and family == "mixtral":
        raise MoEError("model.qkv_bias true: family mixtral has no q/k/v biases; export as family qwen2_moe")
    if "moe" not in kinds:
        return
    problems = [
        ("moe.scheme", moe.scheme, "token_choice"), ("moe.dropless", moe.dropless, True),
        ("moe.n_noop", moe.n_noop, 0), ("moe.activation", moe.activation, "swiglu"),
    ]
    if family == "mixtral":
        problems += [("moe.renormalize", moe.renormalize, True), ("moe.shared_expert_d", moe.shared_expert_d, None)]
    elif moe.shared_expert_d is not None:
        problems.append(("moe.shared_expert_gate", moe.shared_expert_gate, True))
    for name, value, wanted in problems:
        if value != wanted:
            raise MoEError(f"{name} {value!r}: family {family} computes {name} {wanted!r} only")


def moe_config_kwargs(config: Config, family: str) -> dict[str, Any]:
    """The MixtralConfig / Qwen2MoeConfig fields beyond the dense ones."""
    m, moe = config.model, config.moe
    d_expert = moe.d_expert or m.d_ff
    kwargs: dict[str, Any] = {"num_experts_per_tok": moe.top_k, "router_aux_loss_coef": moe.lb_loss_weight,
                              "output_router_logits": False}
    if family == "mixtral":
        return {**kwargs, "num_local_experts": moe.n_experts, "intermediate_size": d_expert, "router_jitter_noise": 0.0}
    kinds = m.block_kinds()
    return {
        **kwargs, "num_experts": moe.n_experts if "moe" in kinds else 0, "moe_intermediate_size": d_expert,
        "intermediate_size": m.d_ff, "norm_topk_prob": moe.renormalize, "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, kind in enumerate(kinds) if kind == "dense"],
        # without a shared expert in mode: one of width 1 with zero weights, which adds exactly 0
        "shared_expert_intermediate_size": moe.shared_expert_d or 1, "qkv_bias": m.qkv_bias,
        "use_sliding_window": False, "sliding_window": None,
    }


def export_moe_layer(ours: dict[str, Tensor], family: str, layer: str, block: str, config: Config) -> dict[str, Tensor]:
    """The HF tensors (per-expert Linear weights, as save_pretrained writes them) of one MoE layer's
    FFN from mode's state `ours` (prefix block, e.g. "blocks.0.ffn.")."""
    hf = f"{layer}{EXPERTS[family]}."
    gate, up, down = EXPERT_NAMES[family]
    state = {hf + "gate.weight": ours[block + "router.router.proj.weight"]}
    w_in, w_out = ours[block + "experts.w_in"], ours[block + "experts.w_out"]  # (E, D, 2F), (E, F, D)
    for e in range(w_in.shape[0]):
        g, u = w_in[e].t().chunk(2)  # (F, D) each
        state[f"{hf}experts.{e}.{gate}.weight"], state[f"{hf}experts.{e}.{up}.weight"] = g, u
        state[f"{hf}experts.{e}.{down}.weight"] = w_out[e].t()  # (D, F)
    if family == "qwen2_moe":
        if config.moe.shared_expert_d is None:
            d = config.model.d_model
            zeros = w_in.new_zeros
            shared = {"gate_proj": zeros(1, d), "up_proj": zeros(1, d), "down_proj": zeros(d, 1)}
            state[hf + "shared_expert_gate.weight"] = zeros(1, d)
        else:
            g, u = ours[block + "shared_expert.gate_up.weight"].chunk(2)
            shared = {"gate_proj": g, "up_proj": u, "down_proj": ours[block + "shared_expert.down.weight"]}
            state[hf + "shared_expert_gate.weight"] = ours[block + "shared_expert_gate.weight"]
        for name, t in shared.items():
            state[f"{hf}shared_expert.{name}.weight"] = t
    return state
