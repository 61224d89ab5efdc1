"""The decoder-only language model. The kind of every block comes from the config."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import Tensor, nn

from mode.config import Config
from mode.layers.block import TransformerBlock
from mode.layers.experts import Experts
from mode.layers.loss import linear_cross_entropy
from mode.layers.mod import MoDBlock
from mode.layers.mode import IntegratedMoDEBlock, StagedMoDEBlock
from mode.layers.moe import MoEFFN
from mode.layers.mor import MoRBlock
from mode.layers.norm import RMSNorm
from mode.layers.rotary import RotaryEmbedding
from mode.routing import DepthRouter, ExpertChoiceRouter, Routing

ROUTING_MODES = ("topk", "causal")


@dataclass
class ModelOutput:
    logits: Tensor | None  # (B, S, V); None when targets were given (the loss is fused)
    loss: Tensor | None = None  # lm_loss + aux_loss, what training minimises
    lm_loss: Tensor | None = None
    aux_loss: Tensor | None = None
    routings: list[Routing | None] = field(default_factory=list)  # one per block: depth routing (MoD)
    ffn_routings: list[Routing | None] = field(default_factory=list)  # one per block: expert routing (MoE)


def build_block(kind: str, config: Config) -> nn.Module:
    if kind == "dense":
        return TransformerBlock(config.model)
    if kind == "mod":
        return MoDBlock(config.model, config.routing)
    if kind == "moe":
        return TransformerBlock(config.model, ffn=MoEFFN(config.model.d_model, config.model.d_ff, config.moe, config.routing))
    if kind == "mode_staged":
        return StagedMoDEBlock(config.model, config.routing, config.moe)
    if kind == "mode_integrated":
        return IntegratedMoDEBlock(config.model, config.moe, config.routing)
    if kind == "mor":
        return MoRBlock(config.model, config.routing, config.mor)
    raise ValueError(f"model.block_pattern: block kind {kind!r} is not available in this build")


class LanguageModel(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        cfg = config.model
        self.config = config
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.rotary = RotaryEmbedding(cfg.head_width, cfg.max_seq_len, cfg.rope_base, cfg.rope_scaling)
        kinds = cfg.block_kinds()  # each block built with its own routing.capacity (a list: one per routed block)
        self.blocks = nn.ModuleList(build_block(kind, config.at_capacity(capacity))
                                    for kind, capacity in zip(kinds, config.routing.layer_capacities(kinds)))
        # The residual stream is this model's own: routed blocks add their updates into it in place
        # (see MoDBlock.forward's residual_owned). False: every block copies (the reference path).
        self.residual_in_place = True
        self._routing_mode = "topk"  # what forward routes by when not told (see routing_mode)
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)  # feeds the unembedding only
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.apply(self._init_weights)
        # Residual output projections start small so the stack starts near identity (GPT-2).
        for name, p in self.named_parameters():
            if name.endswith(("attn.out.weight", "ffn.down.weight", "ffn.experts.w_out")):
                nn.init.normal_(p, std=cfg.init_std / math.sqrt(2 * cfg.n_layers))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.model.init_std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        if isinstance(module, Experts):
            module.reset_parameters(std=self.config.model.init_std)

    def check_causal(self) -> None:
        """Raise a clear error unless every non-causal router of this model has a causal decision."""
        for name, m in self.named_modules():
            if isinstance(m, (DepthRouter, ExpertChoiceRouter)) and m.causal is None:
                raise ValueError(
                    f"{name}: this model was trained with routing.causal=none, so its top-k routing looks at the "
                    "future and it cannot route causally (sample); train it with routing.causal=aux_loss or "
                    "routing.causal=predictor"
                )

    @contextlib.contextmanager
    def routing_mode(self, mode: str) -> Iterator[None]:
        """Within the block this model's forward routes by `mode` when not told otherwise: "topk"
        (training) or "causal" (sampling; see `forward`). The model passes the mode to its blocks;
        a block called directly takes its own causal argument."""
        self._check_mode(mode)
        previous = self._routing_mode
        self._routing_mode = mode
        try:
            yield
        finally:
            self._routing_mode = previous

    def _check_mode(self, mode: str) -> None:
        if mode not in ROUTING_MODES:
            raise ValueError(f"routing_mode must be one of {ROUTING_MODES}, got {mode!r}")
        if mode == "causal":
            self.check_causal()

    def forward(self, tokens: Tensor, targets: Tensor | None = None, routing_mode: str | None = None) -> ModelOutput:
        """tokens (B, S) -> logits (B, S, V); with targets (B, S), the loss too.

        routing_mode "causal": MoD / Staged MoDE depth routers and expert-choice routers route by
        their causal decision (variable token counts, no look-ahead), token choice drops its
        capacity; "topk": training's routing. None: the mode `routing_mode` set (top-k unless set).
        """
        if routing_mode is None:
            routing_mode = self._routing_mode
        else:
            self._check_mode(routing_mode)
        return self._forward(tokens, targets, routing_mode == "causal")

    def _owns_input(self, index: int) -> bool:
        """Whether block `index` may write into its input: the stream is the model's and no hook
        holds it (a forward hook of the block or of the module that produced its input)."""
        producer = self.embed if index == 0 else self.blocks[index - 1]
        return self.residual_in_place and not (_hooked(self.blocks[index], pre=True) or _hooked(producer, pre=False))

    def _forward(self, tokens: Tensor, targets: Tensor | None, causal: bool) -> ModelOutput:
        x = self.embed(tokens)  # (B, S, D)
        angles = self.rotary.prefix(tokens.shape[1])
        routings: list[Routing | None] = []
        ffn_routings: list[Routing | None] = []
        aux_loss = x.new_zeros((), dtype=torch.float32)
        for index, block in enumerate(self.blocks):
            x, info = block(x, angles, causal=causal, residual_owned=self._owns_input(index))
            routings.append(info.routing)
            ffn_routings.append(info.ffn_routing)
            for routing in info.routings():
                aux_loss = aux_loss + routing.aux_loss
        h = self.norm(x)  # (B, S, D)
        if targets is None:
            return ModelOutput(self.lm_head(h), aux_loss=aux_loss, routings=routings, ffn_routings=ffn_routings)
        # With targets the (B, S, V) logits are never materialised: the loss is fused with the
        # unembedding and computed chunk by chunk (mode/layers/loss.py).
        lm_loss = linear_cross_entropy(h, self.lm_head.weight, targets)
        return ModelOutput(None, lm_loss + aux_loss, lm_loss, aux_loss, routings, ffn_routings)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def _hooked(module: nn.Module, pre: bool) -> bool:
    """Whether a forward hook (and with pre, a forward pre-hook) of module, or a global one, sees
    its tensors: a hook may keep them, so nothing may write into them later."""
    hooks = [module._forward_hooks, nn.modules.module._global_forward_hooks]
    if pre:
        hooks += [module._forward_pre_hooks, nn.modules.module._global_forward_pre_hooks]
    return any(len(h) > 0 for h in hooks)
