"""The causal routing decision (the paper's section 3.5): a per-token choice that sees no future
token, trained towards the top-k routing, by the router's own logit or a small predictor."""
from __future__ import annotations

import torch
from torch import Tensor, nn

CAUSAL_METHODS = ("none", "aux_loss", "predictor")


def untrained_for_sampling(routing: str) -> ValueError:
    return ValueError(
        f"this model was trained with routing.causal=none: its routing is {routing}, which looks at the "
        "future and cannot sample; train with routing.causal=aux_loss or predictor"
    )


class CausalPredictor(nn.Module):
    """Method (b) of the paper's section 3.5: a small MLP D -> hidden -> n_out on stop-gradient inputs.

    Its input is detached, so its BCE loss gives gradients to its own parameters only and
    never reaches the language model. Computed in float32 like the router.
    """

    def __init__(self, d_model: int, hidden: int, n_out: int = 1) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden)
        self.fc2 = nn.Linear(hidden, n_out)

    def forward(self, x: Tensor) -> Tensor:
        """x (..., D) -> logits (..., n_out), float32; no gradient flows into x."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            h = nn.functional.gelu(nn.functional.linear(x.detach().float(), self.fc1.weight.float(), self.fc1.bias.float()))
            return nn.functional.linear(h, self.fc2.weight.float(), self.fc2.bias.float())


class CausalDecision(nn.Module):
    """The causal per-token routing decision shared by the depth and expert-choice routers.

    method aux_loss: the decision logit is the router's own logit (sigmoid > 0.5 <=> logit > 0),
    trained with BCE towards top-k membership; the BCE gradient reaches the router (and,
    through it, the model), as in the paper. method predictor: a CausalPredictor on x.detach().
    Targets are always detached top-k memberships. The loss is weight * mean BCE.
    """

    def __init__(self, method: str, d_model: int, n_out: int, weight: float, hidden: int) -> None:
        super().__init__()
        if method not in CAUSAL_METHODS[1:]:
            raise ValueError(f"routing.causal: unknown method {method!r} (expected one of {', '.join(CAUSAL_METHODS)})")
        self.method = method
        self.weight = weight
        self.predictor = CausalPredictor(d_model, hidden, n_out) if method == "predictor" else None

    def logits(self, x: Tensor, router_logits: Tensor) -> Tensor:
        """x (..., D), router_logits (..., n_out) -> decision logits (..., n_out), float32."""
        return router_logits if self.predictor is None else self.predictor(x)

    def loss_and_stats(self, logits: Tensor, member: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """BCE(logits, member) * weight; accuracy of (logit > 0) against member; share decided positive."""
        target = member.detach().to(logits.dtype)
        bce = nn.functional.binary_cross_entropy_with_logits(logits, target)
        decided = logits.detach() > 0
        stats = dict(
            causal_bce=bce.detach(),
            causal_accuracy=(decided == member).float().mean(),
            causal_fraction=decided.float().mean(),
        )
        return self.weight * bce, stats
