"""Conversion of a trained model into a routed one: MoD / MoDE conversion and MoE upcycling.

A checkpoint of a model whose layers are dense (or MoE) becomes the weights of the same model
with another `model.block_pattern`: every layer keeps its attention and norms; a layer that
becomes depth-routed (mod, mode_staged) gets a new depth router; a dense MLP that becomes an MoE
FFN (moe, mode_staged, mode_integrated) is copied into every real expert (upcycling).

What the converted model computes at step 0 (docs/huggingface.md states it for users):
- A new depth router starts at zero weights and, with `routing.router_bias`, bias 1: every
  token's score is 1, so with `routing.gate: identity` the gate is exactly 1 and at capacity 1.0
  the routed block computes x + f(x), the pretrained block. Its weights still get gradients (the
  gate is the score). With a sigmoid gate or no bias the gate is not 1: not the pretrained function.
- Upcycled token choice: every expert is the dense MLP, so a token's output is the sum of its
  top-k gates times the MLP; that is the MLP exactly when the gates sum to 1 (top-k
  renormalisation, `moe.renormalize`) and no token is dropped (`moe.dropless`).
- Upcycled expert choice: a token is computed by the experts that chose it, weighted by its
  router probabilities for those experts; they sum to 1 only if every expert chose the token.
  Not the pretrained function in general.
- Integrated MoDE: a token whose top choice is a no-op slot gets no update. Not the pretrained
  function unless no token picks a no-op.
The new routers of MoE layers keep their random initialisation, which breaks ties between
identical experts.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mode.config import EXPERT_KINDS, Config, ConfigError, config_from_dict, field_differences

DEPTH_KINDS = ("mod", "mode_staged")  # blocks that wrap a TransformerBlock behind a depth router
ROUTER_PROJECTION = "router.proj."  # DepthRouter's scoring projection (a Router), under the block's router


def conversion_differences(source: dict[str, Any], config: Config) -> list[str]:
    """The model fields in which a saved config and config differ, block_pattern left out."""
    return field_differences(source, config, lambda name: name.startswith("model.") and name != "model.block_pattern")


def conversion_source(source: dict[str, Any], config: Config, name: str) -> Config | None:
    """A checkpoint's saved config (read as `name`) when its model differs from config's only in
    which layers are routed; None otherwise (the same model, or another one). The saved config is
    parsed only then: an identical model needs nothing from it but its fields."""
    if conversion_differences(source, config):
        return None
    parsed = config_from_dict(source, name)
    return parsed if parsed.model.block_kinds() != config.model.block_kinds() else None


def converted_state(
    source_state: dict[str, Tensor], source: Config, target_state: dict[str, Tensor], target: Config,
) -> tuple[dict[str, Tensor], list[str]]:
    """The target model's state dict holding a source checkpoint's weights, layer by layer, and
    notes on what the result computes at step 0. target_state: the freshly built target model's
    (its new routers' initial values). Raises ConfigError where a layer cannot be converted."""
    out = dict(target_state)
    sources, targets = source.model.block_kinds(), target.model.block_kinds()
    for i, (was, becomes) in enumerate(zip(sources, targets)):
        for key, value in _layer_state(i, was, becomes, source_state, target, target_state).items():
            if value.shape != out[key].shape:
                raise ConfigError(f"layer {i} ({was} -> {becomes}): {key} is {tuple(value.shape)} in the checkpoint, "
                                  f"{tuple(out[key].shape)} here")
            out[key] = value.to(out[key].dtype)
    for key, value in source_state.items():
        if not key.startswith("blocks."):
            out[key] = value
    return out, conversion_notes(sources, targets, target)


def _layer_state(
    i: int, was: str, becomes: str, state: dict[str, Tensor], target: Config, target_state: dict[str, Tensor],
) -> dict[str, Tensor]:
    """Layer i's target entries, from the checkpoint's layer i."""
    src, dst = f"blocks.{i}.", f"blocks.{i}."
    mine = {k[len(src):]: v for k, v in state.items() if k.startswith(src)}
    if was == becomes:
        return {dst + k: v for k, v in mine.items()}
    if was in DEPTH_KINDS or was == "mode_integrated":
        raise ConfigError(f"model.block_pattern: layer {i} is {was} in the checkpoint; only dense and moe layers "
                          f"convert (to {becomes})")
    if becomes == "mor":
        raise ConfigError(f"model.block_pattern: layer {i} cannot become mor (one block applied several times "
                          "with routers per recursion); conversion makes dense, mod, moe and MoDE layers")
    if becomes in DEPTH_KINDS:
        dst += "block."
    if was == "moe" and becomes not in EXPERT_KINDS:
        raise ConfigError(f"model.block_pattern: layer {i} is moe in the checkpoint and cannot become {becomes} "
                          "(its experts have no dense MLP to become)")
    entries = {dst + k: v for k, v in mine.items() if not k.startswith("ffn.") or was == "moe"}
    if was == "dense" and becomes in EXPERT_KINDS:
        entries.update(_upcycled(mine, dst + "ffn.experts.", target, target_state))
    elif was == "dense":
        entries.update({dst + k: v for k, v in mine.items() if k.startswith("ffn.")})
    if becomes in DEPTH_KINDS:
        entries.update(_unit_depth_router(f"blocks.{i}.router.", target_state))
    return entries


def _upcycled(mine: dict[str, Tensor], prefix: str, target: Config, target_state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A dense SwiGLU MLP copied into every real expert: w_in (E, D, 2F), w_out (E, F, D)."""
    moe = target.moe
    if moe.activation != "swiglu":
        raise ConfigError(f"moe.activation: upcycling copies the dense SwiGLU MLP into the experts; {moe.activation!r} "
                          "experts cannot hold it")
    w_in, w_out = target_state[prefix + "w_in"], target_state[prefix + "w_out"]
    gate_up, down = mine["ffn.gate_up.weight"], mine["ffn.down.weight"]  # (2F, D), (D, F)
    if gate_up.t().shape != w_in.shape[1:]:
        raise ConfigError(f"moe.d_expert: upcycling needs experts as wide as the dense MLP ({down.shape[1]}); "
                          f"they are {w_in.shape[2] // 2}")
    return {
        prefix + "w_in": gate_up.t().unsqueeze(0).expand_as(w_in).clone(),  # (E, D, 2F)
        prefix + "w_out": down.t().unsqueeze(0).expand_as(w_out).clone(),  # (E, F, D)
    }


def _unit_depth_router(prefix: str, target_state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A new depth router (the projection under `prefix`, not its causal predictor) scoring every
    token 1: zero weights, bias 1 where it has a bias."""
    projection = prefix + ROUTER_PROJECTION
    entries = {projection + "weight": torch.zeros_like(target_state[projection + "weight"])}
    if projection + "bias" in target_state:
        entries[projection + "bias"] = torch.ones_like(target_state[projection + "bias"])
    return entries


def conversion_notes(sources: list[str], targets: list[str], target: Config) -> list[str]:
    """What the converted model computes at step 0, per kind of change (see the module docstring)."""
    changed = {(s, t) for s, t in zip(sources, targets) if s != t}
    notes = []
    if any(t in DEPTH_KINDS for _, t in changed):
        r = target.routing
        if r.gate == "identity" and r.router_bias:
            notes.append("new depth routers score every token 1 (identity gate): at routing.capacity 1.0 each routed "
                         "block computes the pretrained block")
        else:
            notes.append("new depth routers start at zero weights; with routing.gate "
                         f"{r.gate!r} and router_bias {r.router_bias} their gate is not 1, so the converted model is "
                         "not the pretrained one even at capacity 1.0 (use gate identity with router_bias true)")
    if any(s == "dense" and t in EXPERT_KINDS for s, t in changed):
        notes.append(_upcycling_note(target, any(t == "mode_integrated" for _, t in changed)))
    return notes


def _upcycling_note(target: Config, integrated: bool) -> str:
    moe = target.moe
    if moe.scheme == "token_choice" and moe.renormalize and moe.dropless:
        exact = "each token's gates sum to 1 and none is dropped: the upcycled FFN computes the dense MLP"
    elif moe.scheme == "token_choice":
        exact = ("the upcycled FFN computes the dense MLP only with renormalised top-k gates (moe.renormalize) and "
                 "no dropped token (moe.dropless)")
    else:
        exact = ("expert choice weights a token's experts by router probabilities that need not sum to 1: the "
                 "upcycled FFN is not the dense MLP")
    noop = "; a token that picks a no-op slot gets no update" if integrated else ""
    return f"dense MLPs copied into {moe.n_experts} experts each: {exact}{noop}"

