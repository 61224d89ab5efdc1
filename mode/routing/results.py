"""What the routers return: one type per kind of routing, each field with one meaning.

Every routing carries its gates, the raw router logits, an auxiliary loss and statistics; what
it says about *who* is processed depends on the router:

- DepthRouting (DepthRouter):                  positions (G, k) chosen per sequence.
- ExpertChoiceRouting (ExpertChoiceRouter):    positions (G, E, C) each expert chose per group.
- CausalExpertRouting (expert choice, causal): mask (..., E) which experts take each token.
- TokenChoiceRouting (TokenChoiceRouter):      slots (T, k) each token chose, and positions (T, k),
                                               each assignment's row in its expert's buffer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from torch import Tensor

from mode.routing.token_choice import CapacityRows


@dataclass(kw_only=True)
class Routing:
    """What every routing holds.

    gates:    g(r) of each routed (token, slot) pair, the shape of the subclass's selection (float32).
    logits:   the raw router scores for every token, (G, T) or (G, T, n_slots), float32;
              kept for auxiliary losses and statistics.
    aux_loss: scalar auxiliary loss this routing adds to the objective (0 when none).
    stats:    detached statistics for logging (see each router).
    """

    gates: Tensor
    logits: Tensor
    aux_loss: Tensor
    stats: dict[str, Tensor] = field(default_factory=dict)


@dataclass(kw_only=True)
class DepthRouting(Routing):
    """A depth router's routing: positions (G, k), the chosen tokens of each sequence, sorted;
    gates (G, k); logits (G, T).

    valid: (G, k) bool, False on padding rows: causal routing pads each sequence's chosen tokens
           to the batch's longest (see DepthRouter.causal_routing); None when every row is chosen.
    """

    positions: Tensor
    valid: Tensor | None = None


@dataclass(kw_only=True)
class ExpertChoiceRouting(Routing):
    """Expert choice's top-C routing: positions (G, E, C), the tokens expert e took in group g,
    sorted within each expert; gates (G, E, C) their softmax probabilities; logits (G, T, E+N)."""

    positions: Tensor
    null_gates: Tensor | None = None  # (G, T, N): every token's no-op slot probabilities, where null experts output


@dataclass(kw_only=True)
class CausalExpertRouting(Routing):
    """Expert choice routed by the causal decision: variable rows per expert.

    mask: (..., E) bool, token t goes to real expert e; gates: (..., E) softmax probabilities of
    the real experts (the same gate the top-C routing uses); logits (..., E+N).
    """

    mask: Tensor
    null_gates: Tensor | None = None  # (..., N): as ExpertChoiceRouting's


@dataclass(kw_only=True)
class TokenChoiceRouting(Routing):
    """Token choice over the T = B*S tokens of a batch (flattened, one group).

    slots:     (T, k) the slots each token chose; slots >= n_experts are no-op experts.
    gates:     (T, k) softmax probabilities of those slots; with moe.renormalize, divided by their sum.
    logits:    (1, T, n_slots).
    positions: (T, k) the assignment's row in its expert's buffer; -1 where nothing is
               computed (a no-op slot, or dropped over capacity). Dropless: 0 for every
               computed assignment (the grouped layout orders rows by sorting on the expert).
    capacity:  rows per expert, or None when dropless.
    layout:    with a capacity, where the row kernels run: the FFN's (E, C) table and rows, from the
               same counting sort as the positions (capacity_positions); None elsewhere.
    """

    slots: Tensor
    positions: Tensor
    capacity: int | None = None
    layout: CapacityRows | None = None


class RoutedTokens(NamedTuple):
    """DepthRouter.route's result: the routing, the chosen tokens (B, k, D) and the residual x
    (B, S, D) they go back into. residual_writable: no autograd node of the router saved x, so
    an owner of x may add the updates into it in place (add_gated_tokens(in_place=True)).
    flat: the chosen positions in the flattened (B*S) axis, where the router has them."""

    routing: DepthRouting
    chosen: Tensor
    residual: Tensor
    residual_writable: bool
    flat: Tensor | None = None
