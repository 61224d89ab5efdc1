"""Router modules: a learned linear score per slot, turned into a Routing by a primitive."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor, nn

from mode.routing.depth import route_tokens
from mode.routing.expert_choice import expert_choice_dispatch, expert_choice_kernel_applies, expert_major_ids
from mode.routing.expert_rows import ExpertRows, expert_choice_rows, gather_rows
from mode.routing.moves import split_tokens
from mode.routing.scores import apply_gate, random_scores, router_scores
from mode.routing.selection import capacity_to_k, count_ids, token_mask, top_k_positions
from mode.routing.token_choice import (
    CapacityRows,
    TokenChoiceHead,
    capacity_positions,
    router_z_loss,
    token_choice_capacity,
    token_choice_head,
)


class RoutedTokens(NamedTuple):
    """DepthRouter.route's result: the routing, the chosen tokens (B, k, D) and the residual x
    (B, S, D) they go back into. residual_writable: no autograd node of the router saved x, so
    an owner of x may add the updates into it in place (add_gated_tokens(in_place=True)).
    flat: the chosen positions in the flattened (B*S) axis, where the router has them."""

    routing: "Routing"
    chosen: Tensor
    residual: Tensor
    residual_writable: bool
    flat: Tensor | None = None


@dataclass
class Routing:
    """What a routed block consumes: who is processed, with which gate weight, and the losses.

    indices: positions chosen within each group, sorted: (G, k) for a depth router,
             (G, E, C) for expert choice over E experts.
    gates:   g(r) for each chosen position, same shape as indices (float32).
    logits:  the raw router scores for every token, (G, T) or (G, T, n_slots), float32;
             kept for auxiliary losses and statistics.
    aux_loss: scalar auxiliary loss this routing adds to the objective (0 when none).
    valid:   (G, k) bool, False on padding rows: a depth router's causal routing pads each
             sequence's chosen tokens to the batch's longest (see DepthRouter.causal_routing);
             None when every row is a chosen token.
    """

    indices: Tensor
    gates: Tensor
    logits: Tensor
    aux_loss: Tensor
    stats: dict[str, Tensor] = field(default_factory=dict)
    valid: Tensor | None = None


def masked_mean(values: Tensor, valid: Tensor | None) -> Tensor:
    """Mean of values (bool or float) over the entries valid marks (broadcast), or over all."""
    values = values.float()
    if valid is None:
        return values.mean()
    mask = valid.expand_as(values)
    return (values * mask).sum() / mask.sum().clamp(min=1)


def untrained_for_sampling(routing: str) -> ValueError:
    return ValueError(
        f"this model was trained with routing.causal=none: its routing is {routing}, which looks at the "
        "future and cannot sample; train with routing.causal=aux_loss or predictor"
    )


class Router(nn.Module):
    """r = w^T x: one linear projection D -> n_slots, computed in float32 for stable top-k."""

    def __init__(self, d_model: int, n_slots: int = 1, bias: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(d_model, n_slots, bias=bias)
        self.n_slots = n_slots

    def forward(self, x: Tensor) -> Tensor:
        """x (G, T, D) -> scores (G, T, n_slots), float32 whatever the autocast dtype."""
        return router_scores(x, self.proj.weight, self.proj.bias)


CAUSAL_METHODS = ("none", "aux_loss", "predictor")


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


class DepthRouter(nn.Module):
    """Mixture-of-Depths router: per sequence, the top-k tokens by score go through the block.

    With a causal decision (routing.causal != none) it also trains that decision (its BCE in
    aux_loss, its accuracy in stats). Called with causal=True (LanguageModel's
    routing_mode="causal"), it routes by the causal decision instead of top-k: a variable
    number of tokens per sequence, padded to the batch maximum (see `causal_routing`).
    causal=None (the default) takes `causal_mode`, the router's own setting (False).
    """

    def __init__(
        self,
        d_model: int,
        capacity: float,
        gate: str,
        random: bool,
        bias: bool = False,
        causal: str = "none",
        causal_loss_weight: float = 0.01,
        predictor_hidden: int = 128,
        random_rows: tuple[int, int] = (0, 1),
    ) -> None:
        super().__init__()
        self.router = Router(d_model, 1, bias)
        # Kept as text: torch.compile holds a str attribute constant (a guard, a recompile for another
        # value), where a float becomes a symbol once a second value is compiled in the process
        # (automatic dynamic), and a size derived from a float symbol cannot enter the depth router's
        # split, an autograd function (torch 2.11 and 2.13 fail compiling it).
        self._capacity = repr(float(capacity))
        self.gate = gate
        self.random = random
        self.set_random_rows(*random_rows)
        self.causal = None if causal == "none" else CausalDecision(causal, d_model, 1, causal_loss_weight, predictor_hidden)
        self.causal_mode = False  # forward's default for causal=None; a model passes causal itself

    @property
    def capacity(self) -> float:
        """Share of each sequence's tokens through the block."""
        return float(self._capacity)

    def set_random_rows(self, rank: int, world: int) -> None:
        """The data-parallel split the random-routing ablation draws for: this process's rank of
        `world` (random_scores); (0, 1) for one process."""
        if not 0 <= rank < world:
            raise ValueError(f"random routing rows: rank {rank} of {world} processes")
        self.random_rows = (rank, world)

    def decide(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Causal decision: x (B, S, D) -> (chosen (B, S) bool, router scores (B, S) float32)."""
        if self.causal is None:
            raise untrained_for_sampling("top-k over the whole sequence")
        scores = self.router(x).squeeze(-1)
        return self.causal.logits(x, scores.unsqueeze(-1)).squeeze(-1) > 0, scores

    def forward(self, x: Tensor, causal: bool | None = None) -> Routing:
        if self.causal_mode if causal is None else causal:
            return self.causal_routing(x)
        scores = self.router(x).squeeze(-1)  # (B, S)
        indices = self._select(scores)
        gates = apply_gate(scores.gather(1, indices), self.gate)  # (B, k)
        aux, stats = self._causal_terms(x, scores, indices)
        return Routing(indices=indices, gates=gates, logits=scores, aux_loss=aux, stats=stats)

    def route(self, x: Tensor, owns_gradient: bool = False, causal: bool | None = None) -> "RoutedTokens":
        """forward(), the chosen tokens (B, k, D) of x and x itself, from split_tokens: what MoDBlock
        consumes (the updates go back into the residual with scatter_add_tokens).

        The loss sees a token's score only through its gate, unless the causal decision is the
        router's own logit (causal=aux_loss: a BCE over every token). Otherwise, with autograd
        on, the scores' gradient flows through the chosen tokens' gates alone (route_tokens):
        the router's backward reads and writes k rows instead of the whole (B, S, D) residual
        (per routed block a weight-gradient GEMV, an outer product and a sum into x's gradient).
        owns_gradient: nothing but the caller holds the gradient that will reach the residual
        (LanguageModel's stream); the chosen tokens' gradient is then added into it in place.
        """
        dense_grad = self.causal is not None and self.causal.method == "aux_loss"
        causal = self.causal_mode if causal is None else causal
        if causal or dense_grad or not torch.is_grad_enabled():
            routing = self(x, causal)  # its scores' backward needs x: the residual is not writable
            return RoutedTokens(routing, *split_tokens(x, routing.indices), residual_writable=False)
        k = capacity_to_k(x.shape[1], self.capacity)
        proj = self.router.proj
        # owns_gradient: the caller's residual gradient is its own (split_tokens' grad_in_place)
        route = route_tokens(x, proj.weight, proj.bias, k, self.gate, self.random, owns_gradient, self.random_rows)
        aux, stats = self._causal_terms(x, route.scores, route.indices)  # a causal predictor saves x for its backward
        routing = Routing(indices=route.indices, gates=route.gates, logits=route.scores, aux_loss=aux, stats=stats)
        return RoutedTokens(routing, route.chosen, route.residual, self.causal is None, route.flat)

    def _select(self, scores: Tensor) -> Tensor:
        """(B, S) scores -> (B, k) chosen positions, sorted."""
        k = capacity_to_k(scores.shape[1], self.capacity)
        # The stochastic-routing ablation changes only *which* tokens are chosen; the gate
        # still comes from the learned score, so learned vs random differs in one thing.
        selection = random_scores(scores, self.random_rows) if self.random else scores
        return top_k_positions(selection.detach(), k)

    def _causal_terms(self, x: Tensor, scores: Tensor, indices: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The causal decision's BCE towards top-k membership and its stats (zero and {} without one)."""
        if self.causal is None:
            return scores.new_zeros(()), {}
        member = token_mask(indices, x.shape[1])  # (B, S): the top-k targets
        return self.causal.loss_and_stats(self.causal.logits(x, scores.unsqueeze(-1)).squeeze(-1), member)

    def causal_routing(self, x: Tensor) -> Routing:
        """Route by the causal decision: indices (B, K), K = the most tokens any sequence chose (>= 1).

        Each row holds its chosen positions in order, then padding: the row's first unchosen
        positions, with gate 0. Padding sits after every chosen token, so under causal
        attention no chosen token sees it, and its zero-gated update leaves it unchanged.
        """
        chosen, scores = self.decide(x)  # (B, S) each
        seq = x.shape[1]
        positions = torch.arange(seq, device=x.device)
        order = torch.where(chosen, positions, positions + seq).argsort(dim=1)  # chosen first, in order
        width = max(1, int(chosen.sum(1).max()))  # data-dependent: one host sync
        indices = order[:, :width]  # (B, K)
        valid = chosen.gather(1, indices)
        gates = torch.where(valid, apply_gate(scores.gather(1, indices), self.gate), 0.0)
        stats = {"processed": chosen.float().mean()}
        return Routing(indices=indices, gates=gates, logits=scores, aux_loss=scores.new_zeros(()), stats=stats, valid=valid)


def set_random_score_rows(model: nn.Module, rank: int, world: int) -> int:
    """Give every depth router of `model` this process's rank of `world` data-parallel processes,
    for the random-routing ablation (DepthRouter.set_random_rows); returns how many it set."""
    routers = [m for m in model.modules() if isinstance(m, DepthRouter)]
    for router in routers:
        router.set_random_rows(rank, world)
    return len(routers)


# ----------------------------------------------------------------------------- expert routers
@dataclass
class TokenChoiceRouting(Routing):
    """Token choice over the T = B*S tokens of a batch (flattened, one group).

    indices:   (T, k) the slots each token chose; slots >= n_experts are no-op experts.
    gates:     (T, k) softmax probabilities of those slots (not renormalised over the k).
    logits:    (1, T, n_slots).
    positions: (T, k) the assignment's row in its expert's buffer; -1 where nothing is
               computed (a no-op slot, or dropped over capacity). Dropless: 0 for every
               computed assignment (the grouped layout orders rows by sorting on the expert).
    capacity:  rows per expert, or None when dropless.
    layout:    with a capacity, where the row kernels run: the FFN's (E, C) table and rows, from the
               same counting sort as the positions (capacity_positions); None elsewhere.
    """

    positions: Tensor | None = None
    capacity: int | None = None
    layout: CapacityRows | None = None  # with a capacity on eager CUDA: the (E, C) layout, built with positions


def _expert_stats(
    tokens_per_expert: Tensor, processed: Tensor, noop: Tensor, dropped: Tensor, lb: Tensor, z: Tensor
) -> dict[str, Tensor]:
    """The statistics every MoE routing reports (detached): see ExpertChoiceRouter / TokenChoiceRouter."""
    stats = dict(
        tokens_per_expert=tokens_per_expert.float(),
        processed=processed, noop_fraction=noop, dropped_fraction=dropped, lb_loss=lb, z_loss=z,
    )
    return {name: value.detach() for name, value in stats.items()}


class ExpertChoiceRouter(nn.Module):
    """Expert choice over E real + N no-op slots: each real expert takes its top-C tokens per group.

    Token-wise softmax over all E+N slots; expert e's gate for token t is that probability.
    A group is `group_size` consecutive sequences; C = capacity_factor * T / (E+N) rounded (halves up).
    No-op slots take nothing: they only compete in the softmax. Routing: indices and gates
    (G, E, C), positions sorted within each expert; logits (G, T, E+N). Aux loss: the z-loss
    (load is balanced by construction). Stats: tokens_per_expert (E,) = G*C each; processed,
    the share of tokens some expert took; noop_fraction = 1 - processed (tokens that ride
    the residual); dropped_fraction 0.
    """

    def __init__(
        self,
        d_model: int,
        n_experts: int,
        n_noop: int,
        capacity_factor: float,
        group_size: int,
        z_loss_weight: float,
        causal: str = "none",
        causal_loss_weight: float = 0.01,
        predictor_hidden: int = 128,
    ) -> None:
        super().__init__()
        self.router = Router(d_model, n_experts + n_noop)
        self.n_experts = n_experts
        self.capacity_factor = capacity_factor
        self.group_size = group_size
        self.z_loss_weight = z_loss_weight
        # Per-expert causal decision: for each real expert e, "is token t in e's top-C?".
        # Method aux_loss trains the raw router logit of slot e; predictor has E outputs.
        self.causal = (
            None if causal == "none" else CausalDecision(causal, d_model, n_experts, causal_loss_weight, predictor_hidden)
        )
        self.causal_mode = False  # forward's default for causal=None; a model passes causal itself

    def decide(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Causal decision: x (..., D) -> (chosen (..., E) bool per real expert, softmax probs (..., E))."""
        if self.causal is None:
            raise untrained_for_sampling("expert-choice top-C over the whole group")
        logits = self.router(x)  # (..., E+N)
        probs = logits.softmax(-1)[..., : self.n_experts]
        return self.causal.logits(x, logits[..., : self.n_experts]) > 0, probs

    def forward(self, x: Tensor, valid: Tensor | None = None, causal: bool | None = None) -> Routing:
        """x (B, S, D). valid (B, S) bool, causal mode only: rows that are padding (False) go to
        no expert and count in no statistic (Staged MoDE under causal routing passes its own).
        causal: route by the causal decision; None takes the router's own `causal_mode`."""
        if self.causal_mode if causal is None else causal:
            return self._causal_forward(x, valid)
        groups, tokens, capacity = self._groups_and_capacity(x)
        logits = self.router(x).reshape(groups, tokens, -1)  # (G, T, E+N), float32
        probs = logits.softmax(-1)[..., : self.n_experts].transpose(1, 2)  # (G, E, T)
        indices = top_k_positions(probs.detach(), capacity)  # (G, E, C)
        gates = probs.gather(2, indices)  # (G, E, C)
        z = router_z_loss(logits)
        processed = token_mask(indices.reshape(groups, -1), tokens).float().mean()
        stats = _expert_stats(
            torch.full((self.n_experts,), groups * capacity, device=x.device), processed, 1 - processed,
            z.new_zeros(()), z.new_zeros(()), z,
        )
        aux = self.z_loss_weight * z
        if self.causal is not None:
            member = torch.zeros_like(probs, dtype=torch.bool).scatter_(2, indices, True).transpose(1, 2)  # (G, T, E)
            causal_logits = self.causal.logits(x.reshape(groups, tokens, -1), logits[..., : self.n_experts])
            causal_aux, causal_stats = self.causal.loss_and_stats(causal_logits, member)
            aux = aux + causal_aux
            stats.update({name: value.detach() for name, value in causal_stats.items()})
            # Per token: the share of tokens the causal decision sends to at least one expert.
            stats["causal_fraction"] = (causal_logits.detach() > 0).any(-1).float().mean()
        return Routing(indices=indices, gates=gates, logits=logits, aux_loss=aux, stats=stats)

    def route(self, x: Tensor) -> tuple[Routing, ExpertRows, Tensor]:
        """forward() (top-C, not causal) and the tokens it chose, gathered expert-major: (routing, their
        ExpertRows, the rows (E*G*C, D) of x (B, S, D)), what MoEFFN's experts consume.

        Eager on CUDA without a causal decision, one autograd function does it all
        (primitives.expert_choice_dispatch): the same routing, losses and statistics, and the backward
        adds the router's input gradient into the gather's in one pass; its gates (G, E, C) are then a
        transposed view of expert-major memory, and its logits carry no gradient (the losses it
        needs are inside). Otherwise forward(), then expert_choice_rows and gather_rows."""
        flat = x.reshape(-1, x.shape[-1])  # (B*S, D): group g is the g-th run of T tokens
        groups, tokens, capacity = self._groups_and_capacity(x)
        weight = self.router.proj.weight
        if self.causal is None and expert_choice_kernel_applies(flat, weight, self.router.proj.bias, groups):
            d = expert_choice_dispatch(flat, weight, groups, self.n_experts, capacity, self.z_loss_weight)
            stats = _expert_stats(d.tokens_per_expert, d.processed, d.noop_fraction, d.zero, d.zero, d.z_loss)
            routing = Routing(indices=d.indices, gates=d.gates, logits=d.logits.view(groups, tokens, -1),
                              aux_loss=d.aux, stats=stats)
            return routing, ExpertRows(d.ids, flat.shape[0], d.inverse), d.rows
        routing = self(x)
        rows = expert_choice_rows(expert_major_ids(routing.indices, tokens), flat)
        return routing, rows, gather_rows(flat, rows)

    def _groups_and_capacity(self, x: Tensor) -> tuple[int, int, int]:
        """x (B, S, D) -> (groups G, tokens per group T, capacity C per expert and group)."""
        batch, seq, _ = x.shape
        if batch % self.group_size != 0:
            raise ValueError(f"moe.group_size ({self.group_size}) must divide the batch size ({batch})")
        tokens = self.group_size * seq
        return batch // self.group_size, tokens, capacity_to_k(tokens, self.capacity_factor / self.router.n_slots)

    def _causal_forward(self, x: Tensor, valid: Tensor | None) -> "CausalExpertRouting":
        """Each real expert takes the rows its causal decision chose (variable counts)."""
        chosen, probs = self.decide(x)  # (B, S, E) each
        if valid is not None:
            chosen = chosen & valid.unsqueeze(-1)
        processed = masked_mean(chosen.any(-1), valid)
        stats = _expert_stats(
            chosen.reshape(-1, self.n_experts).sum(0), processed, 1 - processed,
            processed.new_zeros(()), processed.new_zeros(()), processed.new_zeros(()),
        )
        return CausalExpertRouting(
            indices=chosen, gates=probs, logits=self.router(x), aux_loss=probs.new_zeros(()), stats=stats
        )


@dataclass
class CausalExpertRouting(Routing):
    """Expert choice routed by the causal decision (causal=True): variable rows per expert.

    indices: (..., E) bool, token t goes to real expert e; gates: (..., E) softmax probabilities
    of the real experts (the same gate the top-C routing uses); logits (..., E+N).
    """


class TokenChoiceRouter(nn.Module):
    """Token choice over E real + N no-op slots: each token takes its top-k slots of a softmax.

    Capacity C = ceil(capacity_factor * T * k / (E+N)) rows per real expert with dropping
    (first choices before second ones, earlier tokens first), or dropless. Aux loss:
    lb_loss_weight * Switch load balancing over all slots + z_loss_weight * z-loss.
    Stats: tokens_per_expert (E,) computed rows; processed, the share of tokens some expert
    computed; noop_fraction, the share of the T*k assignments that chose a no-op slot;
    dropped_fraction, the share dropped over capacity; lb_loss; z_loss.
    """

    def __init__(
        self,
        d_model: int,
        n_experts: int,
        n_noop: int,
        top_k: int,
        capacity_factor: float,
        dropless: bool,
        lb_loss_weight: float,
        z_loss_weight: float,
    ) -> None:
        super().__init__()
        self.router = Router(d_model, n_experts + n_noop)
        self.n_experts = n_experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.dropless = dropless
        self.lb_loss_weight = lb_loss_weight
        self.z_loss_weight = z_loss_weight
        self.causal_mode = False  # token choice is causal already; causal mode only drops the capacity

    def forward(self, x: Tensor, valid: Tensor | None = None, causal: bool | None = None) -> TokenChoiceRouting:
        """x (B, S, D). valid (B, S) bool, causal mode only: rows that are padding (False) are
        computed by no expert and left out of the shares and counts in the statistics (Staged
        MoDE under causal routing); the auxiliary losses still see every row. causal: sampling's
        routing (no capacity); None takes the router's own `causal_mode`."""
        causal = self.causal_mode if causal is None else causal
        logits = self.router(x).reshape(1, -1, self.router.n_slots)  # (1, T, E+N), float32
        tokens, n_slots = logits.shape[1:]
        # Under causal routing (sampling) capacity dropping, which depends on the other tokens of
        # the batch, is switched off: every token gets its top-k slots.
        capacity = None if (self.dropless or causal) else token_choice_capacity(tokens, n_slots, self.top_k, self.capacity_factor)
        head = token_choice_head(logits.view(tokens, n_slots), self.top_k, self.n_experts, capacity,
                                 self.lb_loss_weight, self.z_loss_weight)  # gates, slots (T, k) each
        positions, layout = capacity_positions(head.slots, self.n_experts, capacity, x)  # (T, k), eager CUDA: (E, C)
        if valid is not None and causal:
            positions = torch.where(valid.reshape(-1, 1), positions, -1)  # padding: no expert computes it
            stats = self._stats_of_rows(head, positions, valid.reshape(-1, 1))
        else:
            # top-1: a token is processed when its one assignment is computed
            processed = head.computed_fraction if self.top_k == 1 else (positions >= 0).any(-1).float().mean()
            stats = _expert_stats(head.tokens_per_expert, processed, head.noop_fraction, head.dropped_fraction,
                                  head.lb_loss, head.z_loss)
        return TokenChoiceRouting(
            indices=head.slots, gates=head.gates, logits=logits, aux_loss=head.aux_loss, stats=stats,
            positions=positions, capacity=capacity, layout=layout,
        )

    def _stats_of_rows(self, head: TokenChoiceHead, positions: Tensor, rows: Tensor) -> dict[str, Tensor]:
        """Statistics over the rows `rows` (T, 1) marks (causal routing's padding left out), counted
        row by row; the losses still see every row."""
        slots, computed = head.slots, positions >= 0
        real = slots < self.n_experts
        counts = count_ids(torch.where(computed, slots, self.n_experts), self.n_experts + 1)
        return _expert_stats(
            counts[: self.n_experts], masked_mean(computed.any(-1, keepdim=True), rows), masked_mean(~real, rows),
            masked_mean(real & ~computed, rows), head.lb_loss, head.z_loss,
        )
