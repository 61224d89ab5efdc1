"""The `mode` model type of transformers: any mode model (MoD, MoDE, MoE, dense) as a Hugging Face
folder that `AutoModelForCausalLM.from_pretrained` loads once `import mode.hf` has registered it.

config.json holds model_type "mode" and the whole mode Config (`mode_config`, a dict); the
weights are LanguageModel's state dict under the prefix "model." in model.safetensors (a tied
lm_head is saved once, as the embedding). ModeForCausalLM.forward(input_ids, labels=...) gives
logits and, with labels, the next-token loss, routed as sampling routes: causal routing (each
depth router's and expert-choice router's causal decision, as val_loss_causal), for a model trained
with routing.causal aux_loss or predictor. A model trained with routing.causal none has no causal
decision: it is routed by training's top-k over the whole sequence (a token's logits then depend
on later tokens, as in training).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from mode.config import Config, config_from_dict
from mode.layers.rotary import RotaryEmbedding
from mode.model import LanguageModel

MODEL_TYPE = "mode"
IGNORE_INDEX = -100  # labels transformers' losses leave out


class ModeConfig(PretrainedConfig):
    """A mode Config for transformers: mode_config is Config.to_dict(); the usual fields
    (vocab_size, hidden_size, ...) mirror its model section for tools that read them."""

    model_type = MODEL_TYPE

    def __init__(self, mode_config: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.mode_config = mode_config or Config().to_dict()
        m = self.mode_config["model"]
        kwargs.update(vocab_size=m["vocab_size"], hidden_size=m["d_model"], num_hidden_layers=m["n_layers"],
                      num_attention_heads=m["n_heads"], max_position_embeddings=m["max_seq_len"],
                      tie_word_embeddings=m["tie_embeddings"])
        super().__init__(**kwargs)

    def mode(self) -> Config:
        return config_from_dict(self.mode_config, "config.json mode_config")


class ModeForCausalLM(PreTrainedModel):
    """A mode LanguageModel (`self.model`) behind transformers' causal-LM interface."""

    config_class = ModeConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["TransformerBlock", "MoDBlock", "StagedMoDEBlock", "IntegratedMoDEBlock"]

    def __init__(self, config: ModeConfig) -> None:
        super().__init__(config)
        self.model = LanguageModel(config.mode())
        tied = config.mode_config["model"]["tie_embeddings"]
        self._tied_weights_keys = {"model.lm_head.weight": "model.embed.weight"} if tied else None
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: torch.nn.Module) -> None:
        """Weights come from the checkpoint (LanguageModel initialised itself when built). The rotary
        tables are not saved: from_pretrained builds the model on the meta device and leaves them
        empty, so they are computed again here."""
        if isinstance(module, RotaryEmbedding):
            m = self.config.mode().model
            fresh = RotaryEmbedding(m.head_width, m.max_seq_len, m.rope_base, m.rope_scaling)
            for name, table in fresh.named_buffers():
                getattr(module, name).copy_(table)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.lm_head

    def routing_mode(self) -> str:
        """causal where every router that needs one has a causal decision, else training's topk."""
        return "topk" if self.model.config.routing.causal == "none" else "causal"

    def forward(self, input_ids: Tensor, labels: Tensor | None = None, attention_mask: Tensor | None = None,
                **kwargs: Any) -> CausalLMOutput:
        """input_ids (B, S) -> logits (B, S, V); with labels (B, S), the mean cross-entropy of
        logits[:, :-1] against labels[:, 1:] (-100: left out), as every transformers causal LM.
        attention_mask: only all ones (mode has no padding within a sequence)."""
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("ModeForCausalLM: attention_mask with padding is not supported (give unpadded sequences)")
        logits = self.model(input_ids, routing_mode=self.routing_mode()).logits  # (B, S, V)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device),
                                   ignore_index=IGNORE_INDEX)
        return CausalLMOutput(loss=loss, logits=logits)


def save_mode(model: LanguageModel, folder: Path) -> None:
    """config.json and model.safetensors of the mode type into folder (which exists, empty)."""
    from safetensors.torch import save_file

    config = ModeConfig(mode_config=model.config.to_dict(), architectures=[ModeForCausalLM.__name__],
                        dtype=str(model.embed.weight.dtype).removeprefix("torch."))
    state = {f"model.{name}": t.detach().contiguous().clone() for name, t in model.state_dict().items()}
    if model.config.model.tie_embeddings:
        del state["model.lm_head.weight"]  # the embedding's: saved once
    (folder / "config.json").write_text(config.to_json_string(use_diff=False), encoding="utf-8")
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def register() -> None:
    """Make AutoConfig / AutoModelForCausalLM know model_type "mode" (idempotent)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if MODEL_TYPE in CONFIG_MAPPING:
        return
    AutoConfig.register(MODEL_TYPE, ModeConfig)
    AutoModelForCausalLM.register(ModeConfig, ModeForCausalLM)
