"""The MoE routers: expert choice (each expert takes its top-C tokens of a group) and token
choice (each token takes its top-k experts), both over E real and N no-op slots."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from mode.routing.causal import CausalDecision, untrained_for_sampling
from mode.routing.expert_choice import expert_choice_dispatch, expert_choice_kernel_applies, expert_major_ids
from mode.routing.expert_rows import ExpertRows, expert_choice_rows, gather_rows
from mode.routing.results import CausalExpertRouting, ExpertChoiceRouting, TokenChoiceRouting
from mode.routing.router import Router
from mode.routing.selection import capacity_to_k, count_ids, token_mask, top_k_positions
from mode.routing.token_choice import (
    TokenChoiceHead,
    balanced_bias_step,
    capacity_positions,
    dropless_positions,
    router_z_loss,
    token_choice_capacity,
    token_choice_head,
)


def masked_mean(values: Tensor, valid: Tensor | None) -> Tensor:
    """Mean of values (bool or float) over the entries valid marks (broadcast), or over all."""
    values = values.float()
    if valid is None:
        return values.mean()
    mask = valid.expand_as(values)
    return (values * mask).sum() / mask.sum().clamp(min=1)


def _expert_stats(
    tokens_per_expert: Tensor, processed: Tensor, noop: Tensor, dropped: Tensor, lb: Tensor, z: Tensor
) -> dict[str, Tensor]:
    """The statistics every MoE routing reports (detached): see ExpertChoiceRouter / TokenChoiceRouter."""
    stats = dict(
        tokens_per_expert=tokens_per_expert.float(),
        processed=processed, noop_fraction=noop, dropped_fraction=dropped, lb_loss=lb, z_loss=z,
    )
    return {name: value.detach() for name, value in stats.items()}


def fixed_counts(n_experts: int, count: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Expert choice's statistics that do not depend on the routing: every expert's count (E,) and
    a zero (no token dropped, no balancing loss), views of one float32 tensor: one fill compiled,
    not one kernel each."""
    fixed = torch.where(torch.arange(n_experts + 1, device=device) < n_experts, float(count), 0.0).float()  # (E+1,)
    return fixed[:n_experts], fixed[n_experts]


class ExpertChoiceRouter(nn.Module):
    """Expert choice over E real + N no-op slots: each real expert takes its top-C tokens per group.

    Token-wise softmax over all E+N slots; expert e's gate for token t is that probability.
    A group is `group_size` consecutive sequences; C = capacity_factor * T / (E+N) rounded (halves up).
    No-op slots take nothing: they only compete in the softmax. ExpertChoiceRouting: positions
    and gates (G, E, C), positions sorted within each expert; logits (G, T, E+N). Aux loss: the z-loss
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
        null_gates: bool = False,
    ) -> None:
        super().__init__()
        self.router = Router(d_model, n_experts + n_noop)
        self.n_experts = n_experts
        # Whether the routing carries every token's no-op slot probabilities (copy / constant null experts).
        self.null_gates = null_gates
        self.capacity_factor = capacity_factor
        self.group_size = group_size
        self.z_loss_weight = z_loss_weight
        # Per-expert causal decision: for each real expert e, "is token t in e's top-C?".
        # Method aux_loss trains the raw router logit of slot e; predictor has E outputs.
        self.causal = (
            None if causal == "none" else CausalDecision(causal, d_model, n_experts, causal_loss_weight, predictor_hidden)
        )

    def decide(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Causal decision: x (..., D) -> (chosen (..., E) bool per real expert, softmax probs (..., E))."""
        if self.causal is None:
            raise untrained_for_sampling("expert-choice top-C over the whole group")
        logits = self.router(x)  # (..., E+N)
        probs = logits.softmax(-1)[..., : self.n_experts]
        return self.causal.logits(x, logits[..., : self.n_experts]) > 0, probs

    def forward(self, x: Tensor, valid: Tensor | None = None, causal: bool = False, with_stats: bool = True
                ) -> ExpertChoiceRouting | CausalExpertRouting:
        """x (B, S, D). valid (B, S) bool, causal mode only: rows that are padding (False) go to
        no expert and count in no statistic (Staged MoDE under causal routing passes its own).
        causal: route by the causal decision (a CausalExpertRouting), else top-C. with_stats: False
        leaves the causal routing's statistics empty (inference); top-C always has them."""
        if causal:
            return self._causal_forward(x, valid, with_stats)
        groups, tokens, capacity = self._groups_and_capacity(x)
        logits = self.router(x).reshape(groups, tokens, -1)  # (G, T, E+N), float32
        every = logits.softmax(-1)
        probs = every[..., : self.n_experts].transpose(1, 2)  # (G, E, T)
        positions = top_k_positions(probs.detach(), capacity)  # (G, E, C)
        gates = probs.gather(2, positions)  # (G, E, C)
        z = router_z_loss(logits)
        processed = token_mask(positions.reshape(groups, -1), tokens).float().mean()
        counts, zero = fixed_counts(self.n_experts, groups * capacity, x.device)
        stats = _expert_stats(counts, processed, 1 - processed, zero, zero, z)
        aux = self.z_loss_weight * z
        if self.causal is not None:
            member = torch.zeros_like(probs, dtype=torch.bool).scatter_(2, positions, True).transpose(1, 2)  # (G, T, E)
            causal_logits = self.causal.logits(x.reshape(groups, tokens, -1), logits[..., : self.n_experts])
            causal_aux, causal_stats = self.causal.loss_and_stats(causal_logits, member)
            aux = aux + causal_aux
            stats.update({name: value.detach() for name, value in causal_stats.items()})
            # Per token: the share of tokens the causal decision sends to at least one expert.
            stats["causal_fraction"] = (causal_logits.detach() > 0).any(-1).float().mean()
        null = every[..., self.n_experts :] if self.null_gates else None  # (G, T, N)
        return ExpertChoiceRouting(positions=positions, gates=gates, logits=logits, aux_loss=aux, stats=stats,
                                   null_gates=null)

    def route(self, x: Tensor) -> tuple[ExpertChoiceRouting, ExpertRows, Tensor]:
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
            d = expert_choice_dispatch(flat, weight, groups, self.n_experts, capacity, self.z_loss_weight,
                                       self.null_gates)
            stats = _expert_stats(d.tokens_per_expert, d.processed, d.noop_fraction, d.zero, d.zero, d.z_loss)
            null = None if d.null_probs is None else d.null_probs.view(groups, tokens, -1)  # (G, T, N)
            routing = ExpertChoiceRouting(positions=d.indices, gates=d.gates, logits=d.logits.view(groups, tokens, -1),
                                          aux_loss=d.aux, stats=stats, null_gates=null)
            return routing, ExpertRows(d.ids, flat.shape[0], d.inverse), d.rows
        routing = self(x)
        rows = expert_choice_rows(expert_major_ids(routing.positions, tokens), flat)
        return routing, rows, gather_rows(flat, rows)

    def _groups_and_capacity(self, x: Tensor) -> tuple[int, int, int]:
        """x (B, S, D) -> (groups G, tokens per group T, capacity C per expert and group)."""
        batch, seq, _ = x.shape
        if batch % self.group_size != 0:
            raise ValueError(f"moe.group_size ({self.group_size}) must divide the batch size ({batch})")
        tokens = self.group_size * seq
        return batch // self.group_size, tokens, capacity_to_k(tokens, self.capacity_factor / self.router.n_slots)

    def _causal_forward(self, x: Tensor, valid: Tensor | None, with_stats: bool = True) -> CausalExpertRouting:
        """Each real expert takes the rows its causal decision chose (variable counts)."""
        chosen, probs = self.decide(x)  # (B, S, E) each
        if valid is not None:
            chosen = chosen & valid.unsqueeze(-1)
        stats = {}
        if with_stats:
            processed = masked_mean(chosen.any(-1), valid)
            stats = _expert_stats(
                chosen.reshape(-1, self.n_experts).sum(0), processed, 1 - processed,
                processed.new_zeros(()), processed.new_zeros(()), processed.new_zeros(()),
            )
        logits = self.router(x)
        null = logits.softmax(-1)[..., self.n_experts :] if self.null_gates else None  # (B, S, N)
        return CausalExpertRouting(
            mask=chosen, gates=probs, logits=logits, aux_loss=probs.new_zeros(()), stats=stats, null_gates=null,
        )


class TokenChoiceRouter(nn.Module):
    """Token choice over E real + N no-op slots: each token takes its top-k slots of a softmax.

    Capacity C = ceil(capacity_factor * T * k / (E+N)) rows per real expert with dropping
    (first choices before second ones, earlier tokens first), or dropless. renormalize: the
    gates are the k probabilities divided by their sum (Mixtral), else the probabilities. score:
    the probabilities are a softmax over the slots or each slot's sigmoid (DeepSeek-V3).
    bias_update_rate > 0: a per-expert bias buffer (E,) is added to the probabilities for choosing
    only (update_bias moves it after each step), and stats gain expert_load (E,). jitter: training
    multiplies the router's input by uniform noise in [1 - jitter, 1 + jitter]. Aux loss:
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
        renormalize: bool = False,
        score: str = "softmax",
        bias_update_rate: float = 0.0,
        jitter: float = 0.0,
    ) -> None:
        super().__init__()
        self.router = Router(d_model, n_experts + n_noop)
        self.n_experts = n_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.score = score
        self.jitter = jitter
        self.bias_update_rate = bias_update_rate
        if bias_update_rate > 0:
            # Persistent: a resumed run chooses as the uninterrupted one; no gradient ever reaches it.
            self.register_buffer("expert_bias", torch.zeros(n_experts))
        else:
            self.expert_bias = None
        self.capacity_factor = capacity_factor
        self.dropless = dropless
        self.lb_loss_weight = lb_loss_weight
        self.z_loss_weight = z_loss_weight

    def forward(self, x: Tensor, valid: Tensor | None = None, causal: bool = False,
                with_stats: bool = True) -> TokenChoiceRouting:
        """x (B, S, D). valid (B, S) bool, causal mode only: rows that are padding (False) are
        computed by no expert and left out of the shares and counts in the statistics (Staged
        MoDE under causal routing); the auxiliary losses still see every row. causal: sampling's
        routing (no capacity): token choice is causal already, causal routing only drops the capacity.
        with_stats: False leaves stats empty (inference: nothing reads them)."""
        logits = self.router(self._jittered(x)).reshape(1, -1, self.router.n_slots)  # (1, T, E+N), float32
        tokens, n_slots = logits.shape[1:]
        # Under causal routing (sampling) capacity dropping, which depends on the other tokens of
        # the batch, is switched off: every token gets its top-k slots.
        capacity = None if (self.dropless or causal) else token_choice_capacity(tokens, n_slots, self.top_k, self.capacity_factor)
        head = token_choice_head(logits.view(tokens, n_slots), self.top_k, self.n_experts, capacity,
                                 self.lb_loss_weight, self.z_loss_weight, self.score,
                                 self.expert_bias)  # gates, slots (T, k) each
        rows = valid.reshape(-1, 1) if valid is not None and causal else None  # (T, 1): the real tokens
        if capacity is None:  # padding: no expert computes it
            positions, layout = dropless_positions(head.slots, self.n_experts, rows), None  # (T, k)
        else:  # not causal: every row is a token
            positions, layout = capacity_positions(head.slots, self.n_experts, capacity, x)  # (T, k), eager CUDA: (E, C)
        if not with_stats:
            stats = {}
        elif rows is not None:
            stats = self._stats_of_rows(head, positions, rows)
        else:
            # top-1: a token is processed when its one assignment is computed
            processed = head.computed_fraction if self.top_k == 1 else (positions >= 0).any(-1).float().mean()
            stats = _expert_stats(head.tokens_per_expert, processed, head.noop_fraction, head.dropped_fraction,
                                  head.lb_loss, head.z_loss)
        if self.expert_bias is not None and with_stats:
            # What the bias update needs: the assignments each real expert was chosen for (before any
            # capacity), padding rows left out; the trainer sums them over micro-batches and processes.
            chosen = head.slots if rows is None else torch.where(rows, head.slots, n_slots)
            stats["expert_load"] = count_ids(chosen, n_slots + 1)[: self.n_experts].float()
        # The k probabilities over their sum: the softmax of the top-k logits alone.
        gates = head.gates / head.gates.sum(-1, keepdim=True) if self.renormalize else head.gates
        return TokenChoiceRouting(
            slots=head.slots, gates=gates, logits=logits, aux_loss=head.aux_loss, stats=stats,
            positions=positions, capacity=capacity, layout=layout,
        )

    def _jittered(self, x: Tensor) -> Tensor:
        """The router's input: in training with moe.jitter = eps, x times uniform noise in [1 - eps, 1 + eps]
        (drawn from the run's generator), else x itself. The experts always see x unjittered."""
        if not (self.training and self.jitter > 0):
            return x
        return x * torch.empty_like(x).uniform_(1.0 - self.jitter, 1.0 + self.jitter)

    @torch.no_grad()
    def update_bias(self, loads: Tensor) -> None:
        """After an optimizer step: move the selection bias towards balance, given loads (E,), the
        "expert_load" statistics of the step summed over its micro-batches and every process (so that
        every process updates alike)."""
        if self.expert_bias is None:
            raise RuntimeError("update_bias: this router has no selection bias (moe.bias_update_rate = 0)")
        balanced_bias_step(self.expert_bias, loads.to(self.expert_bias.device), self.bias_update_rate)

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


def bias_balanced_routers(model: nn.Module) -> list[TokenChoiceRouter]:
    """The token-choice routers of model that balance by a selection bias (moe.bias_update_rate > 0),
    in module order, which is layer order."""
    return [m for m in model.modules() if isinstance(m, TokenChoiceRouter) and m.expert_bias is not None]
