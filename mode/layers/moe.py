"""Mixture-of-Experts FFN on the shared router primitives: expert choice or token choice.

FFN(x)_t = sum over the real experts e that process token t of gate_{t,e} * expert_e(x_t),
plus, with a shared expert, shared(x_t) (times sigmoid(x_t W_g) with its gate) for every token.
Without one, a token that only no-op experts took (or that no expert took, or that was dropped)
gets an exact zero update: it rides the residual. No-op experts are never computed; those of
kind copy or constant (moe.noop_kind) add their gate times x_t or a learned vector.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from mode.config import MoEConfig, RoutingConfig
from mode.kernels import use_triton
from mode.layers.experts import Experts, check_backend, megablocks_token_choice
from mode.layers.mlp import SwiGLU
from mode.routing import (
    CausalExpertRouting,
    ExpertChoiceRouter,
    ExpertChoiceRouting,
    ExpertRows,
    Routing,
    TokenChoiceRouter,
    TokenChoiceRouting,
    combine_rows,
    count_ids,
    dropless_rows,
    gather_rows,
    padded_gates,
    rows_by_slot,
    slot_table,
    sort_by_expert,
    token_choice_rows,
)
from mode.routing.expert_router import masked_mean


class NullExperts(nn.Module):
    """The no-op slots that output something (MoE++): a copy slot outputs the token's FFN input, a
    constant slot its learned vector v_j (zeros at first), a zero slot nothing; each times its gate.
    out_t = sum_j g_tj * (x_t | v_j | 0): no work per token but the gate's product, computed where
    the token is (expert parallelism exchanges the real experts' rows only)."""

    def __init__(self, kinds: list[str], d_model: int) -> None:
        super().__init__()
        self.kinds = kinds
        self.register_buffer("copy", torch.tensor([k == "copy" for k in kinds], dtype=torch.float32), persistent=False)
        slots = [j for j, kind in enumerate(kinds) if kind == "constant"]
        self.register_buffer("constant_slots", torch.tensor(slots, dtype=torch.long), persistent=False)
        self.register_buffer("constant", torch.tensor([k == "constant" for k in kinds], dtype=torch.float32),
                             persistent=False)
        self.constants = nn.Parameter(torch.zeros(len(slots), d_model)) if slots else None

    def forward(self, x: Tensor, gates: Tensor) -> Tensor:
        """x (T, D), gates (T, N) each token's gate of each no-op slot (0 where not chosen) -> (T, D).
        Only the kinds present are computed: a product with an all-zero copy vector would cost a
        (T, D) pass each way, and its backward another into x's gradient, for zeros."""
        out = None
        if "copy" in self.kinds:
            # A sum, not a matmul: autocast would round the gates' sum to bf16 (and its gradient).
            out = self._summed(gates, self.copy).unsqueeze(-1) * x  # (T, 1) * (T, D)
        if self.constants is not None:
            constant = self._constant_sum(gates.index_select(1, self.constant_slots))  # (T, D)
            out = constant if out is None else out + constant
        if out is None:  # zero slots only: MoEFFN builds no NullExperts for them
            raise ValueError("NullExperts: no copy or constant slot")
        return out

    def add_to(self, out: Tensor, x: Tensor, gates: Tensor) -> Tensor:
        """out (T, D) plus forward(x, gates) in out's dtype: one kernel each way where the policy
        allows (mode/kernels/null_experts.py, summed in float32), else the PyTorch ops."""
        if not use_triton(out, "rows"):
            return out + self(x, gates).to(out.dtype)
        from mode.kernels.null_experts import null_add  # Triton: imported where it runs

        gates = gates.float()
        scale = self._summed(gates, self.copy) if "copy" in self.kinds else None  # (T,): the copy slots' gates
        constant_gates = None if self.constants is None else gates.index_select(1, self.constant_slots)  # (T, C)
        return null_add(out, x, scale, constant_gates, self.constants)

    def _constant_sum(self, gates: Tensor) -> Tensor:
        """gates (T, C) the constant slots' gates -> (T, D) sum_c g_tc * v_c in float32, as the kernel
        sums it (float64 stays float64): one product per slot (C is a few), not a matmul, which
        autocast would run in bf16."""
        dtype = torch.promote_types(torch.promote_types(gates.dtype, self.constants.dtype), torch.float32)
        constants, gates = self.constants.to(dtype), gates.to(dtype)
        out = gates[:, :1] * constants[0]  # (T, 1) * (D,)
        for c in range(1, constants.shape[0]):
            out = out + gates[:, c:c + 1] * constants[c]
        return out

    @staticmethod
    def _summed(gates: Tensor, kind: Tensor) -> Tensor:
        """gates (T, N), kind (N,) 1 at a kind's slots -> (T,) each token's gates of that kind summed,
        in the gates' dtype."""
        return (gates * kind.to(gates.dtype)).sum(-1)

    def stats(self, gates: Tensor, valid: Tensor | None) -> dict[str, Tensor]:
        """Per kind that outputs something: the mean over tokens of its slots' summed gates (copy_gate,
        constant_gate), padding rows (valid (T, 1) False) left out."""
        out = {}
        for kind in ("copy", "constant"):
            if kind in self.kinds:
                mass = self._summed(gates, getattr(self, kind))  # (T,)
                out[f"{kind}_gate"] = masked_mean(mass.unsqueeze(-1), valid).detach()
        return out


def token_choice_null_gates(slots: Tensor, gates: Tensor, n_experts: int, n_null: int) -> Tensor:
    """Token choice: slots, gates (T, k) -> (T, N) each token's gate of each no-op slot (0 where not chosen)."""
    null_slots = torch.arange(n_experts, n_experts + n_null, device=slots.device)
    chosen = slots.unsqueeze(-1) == null_slots  # (T, k, N)
    return (chosen * gates.unsqueeze(-1)).sum(1)


def static_assignments(routing: TokenChoiceRouting | CausalExpertRouting, n_experts: int
                       ) -> tuple[Tensor, Tensor, Tensor]:
    """A causal routing of T tokens as J assignments per token -> (slots, positions, gates) (T, J) each,
    position < 0 where no expert computes the assignment: token choice's top-k as they are, a
    causal expert-choice decision as one assignment per real expert (J = E), taken where chosen."""
    if isinstance(routing, TokenChoiceRouting):
        return routing.slots, routing.positions, routing.gates
    chosen = routing.mask.reshape(-1, n_experts)  # (T, E)
    slots = torch.arange(n_experts, device=chosen.device).expand_as(chosen).contiguous()
    return slots, torch.where(chosen, 0, -1), routing.gates.reshape(-1, n_experts)


def expert_weights(slots: Tensor, positions: Tensor, gates: Tensor, n_experts: int) -> Tensor:
    """Assignments (T, J) each -> (T, E) each token's gate for each real expert, 0 where none computes it."""
    computed = torch.where(positions >= 0, slots, n_experts)  # (T, J): the no-op and uncomputed in column E
    weights = gates.new_zeros(slots.shape[0], n_experts + 1)
    return weights.scatter_add(1, computed, gates)[:, :n_experts]  # a token takes each real expert at most once


class MoEFFN(nn.Module):
    """x (B, S, D) -> (FFN output (B, S, D), Routing). A routed FFN: TransformerBlock reports its Routing."""

    def __init__(self, d_model: int, d_ff: int, moe: MoEConfig, routing: RoutingConfig | None = None) -> None:
        super().__init__()
        check_backend(moe.backend)
        kinds = moe.noop_kinds()
        # Only where some no-op slot outputs something: zero slots need no module (today's models).
        self.null_experts = NullExperts(kinds, d_model) if any(kind != "zero" for kind in kinds) else None
        if moe.scheme == "expert_choice":
            # routing.causal gives expert choice (not causal: top-C over a group) a causal decision.
            causal = routing or RoutingConfig()
            self.router = ExpertChoiceRouter(
                d_model, moe.n_experts, moe.n_noop, moe.capacity_factor, moe.group_size, moe.z_loss_weight,
                causal.causal, causal.causal_loss_weight, causal.predictor_hidden, self.null_experts is not None,
            )
        else:
            self.router = TokenChoiceRouter(
                d_model, moe.n_experts, moe.n_noop, moe.top_k, moe.capacity_factor, moe.dropless,
                moe.lb_loss_weight, moe.z_loss_weight, moe.renormalize, moe.score, moe.bias_update_rate, moe.jitter,
            )
        self.experts = Experts(moe.n_experts, d_model, moe.d_expert or d_ff, moe.activation, moe.backend)
        # An always-on expert (Qwen2-MoE, DeepSeekMoE), optionally scaled by a sigmoid gate.
        self.shared_expert = None if moe.shared_expert_d is None else SwiGLU(d_model, moe.shared_expert_d)
        self.shared_expert_gate = nn.Linear(d_model, 1, bias=False) if moe.shared_expert_gate else None

    def forward(self, x: Tensor, valid: Tensor | None = None, causal: bool = False, static: bool = False,
                with_stats: bool = True, residual: Tensor | None = None) -> tuple[Tensor, Routing]:
        """valid (B, S) bool: under causal routing, False rows are padding: no expert computes
        them (their output is 0) and the statistics leave them out. None: every row is a token.
        causal: route as sampling does (see the routers). static: a decode step's pass, routed
        causally with no host sync and no shape that depends on the routing (_static_experts), so
        that a CUDA graph can capture it. with_stats: compute the routing's statistics (False: its
        stats are empty; inference, where nothing reads them, skips their kernels). residual (B, S, D):
        returned plus the FFN's output; top-C expert choice sums its rows straight into it (no
        zero-filled output to add afterwards)."""
        out, routing = self._routed(x, valid, causal or static, static, with_stats, residual)
        if self.null_experts is not None:
            out = self._plus_null(out, x, routing, valid, with_stats)
        if self.shared_expert is not None:
            out = out + self._shared(x, valid)
        return out, routing

    def _routed(self, x: Tensor, valid: Tensor | None, causal: bool, static: bool = False,
                with_stats: bool = True, residual: Tensor | None = None) -> tuple[Tensor, Routing]:
        """The routed experts' part of forward: (their output (B, S, D) plus residual, the routing)."""
        if isinstance(self.router, ExpertChoiceRouter) and not causal:
            routing, rows, xs = self.router.route(x)
            into = None if residual is None else residual.reshape(-1, residual.shape[-1])  # (B*S, D)
            return self._expert_choice(routing, rows, xs, into).view_as(x), routing
        routing = self.router(x, valid, causal, with_stats)
        if static:
            out = self._static_experts(x.reshape(-1, x.shape[-1]), routing)
        elif isinstance(routing, CausalExpertRouting):
            out = self._causal_experts(x.reshape(-1, x.shape[-1]), routing)
        else:
            out = self._token_choice(x.reshape(-1, x.shape[-1]), routing)
        out = out.view_as(x)
        return (out if residual is None else residual + out), routing

    def _plus_null(self, out: Tensor, x: Tensor, routing: Routing, valid: Tensor | None,
                   with_stats: bool = True) -> Tensor:
        """out (B, S, D) plus the no-op slots' outputs (NullExperts), their statistics added to
        routing.stats. Expert choice: every token at its softmax probability of each slot (no-op slots
        have no capacity); token choice: the slots a token chose, at their gates."""
        flat = x.reshape(-1, x.shape[-1])  # (T, D)
        n_null = len(self.null_experts.kinds)
        if isinstance(routing, TokenChoiceRouting):
            gates = token_choice_null_gates(routing.slots, routing.gates, self.experts.n_experts, n_null)
        else:
            gates = routing.null_gates.reshape(-1, n_null)  # (T, N)
        rows = None if valid is None else valid.reshape(-1, 1)
        if rows is not None:
            gates = torch.where(rows, gates, 0)  # padding: a zero update
        if with_stats:
            routing.stats.update(self.null_experts.stats(gates, rows))
        return self.null_experts.add_to(out.reshape(-1, out.shape[-1]), flat, gates).view_as(out)

    def _shared(self, x: Tensor, valid: Tensor | None) -> Tensor:
        """The shared expert on every token of x (B, S, D), times its sigmoid gate where it has one;
        padding rows (valid False) get a zero update, as from the routed experts."""
        out = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            out = torch.sigmoid(self.shared_expert_gate(x)) * out  # (B, S, 1) * (B, S, D)
        return out if valid is None else torch.where(valid.unsqueeze(-1), out, 0)

    def syncs_with_host(self, x: Tensor, causal: bool = False) -> bool:
        """Whether a pass on tokens like x reads routing results on the host (so no CUDA graph can
        capture it): token choice sorted by expert with host counts, that is dropless (or under
        causal routing) except by ends on the torch backend, or on a grouped backend."""
        if isinstance(self.router, ExpertChoiceRouter):
            return causal  # causal decisions: variable counts
        if self.experts.backend != "torch":
            return True
        dropless = self.router.dropless or causal
        return dropless and not self.experts.by_ends_applies(x)

    def _experts_combined(self, xs: Tensor, gates: Tensor, rows: ExpertRows, counts: Tensor | None = None,
                          ends: Tensor | None = None, computed: Tensor | None = None, on_device: bool = False,
                          into: Tensor | None = None) -> Tensor:
        """The experts on their rows xs, padded (E, R, D), grouped (M, D) by counts (E,) on the host, or
        (R, D) by ends (E,) on the device (Experts.by_ends, computed its mask where the rows have no
        inverse map; on_device: through torch._grouped_mm on any backend); each row's output times its
        gate (gates (R_total,), rows' order), summed into its token -> (T, D).
        Where the experts' activation kernel can take the gates, it applies them (the combine is then a
        plain sum, its backward a gather); otherwise the combine does."""
        to_experts = gates if self.experts.gates_in_activation(xs) else None
        if ends is not None:
            ys = self.experts.by_ends(xs, ends, to_experts, computed, on_device)  # (R, D)
        elif counts is None:
            ys = self.experts.padded(xs, to_experts)  # (E, R, D)
        else:
            ys = self.experts.grouped(xs, counts, to_experts)  # (M, D)
        # Combined in the experts' compute dtype (bf16 under autocast), like a dense FFN's output.
        return combine_rows(ys.reshape(-1, ys.shape[-1]), gates if to_experts is None else None, rows, into)

    def decode_reads_chosen_experts(self, x: Tensor) -> bool:
        """Whether a decode step's experts (_static_experts) for tokens like x read only the experts
        its rows chose (grouped GEMMs over device offsets), not every expert's weights."""
        return self.experts.static_grouped_applies(x)

    def _static_experts(self, x: Tensor, routing: TokenChoiceRouting | CausalExpertRouting) -> Tensor:
        """A decode step's routed experts: x (T, D) -> (T, D), with no host sync and static shapes.
        Every assignment is a row sorted by expert, and grouped GEMMs over the device-side ends read
        only the chosen experts' weights (batch 1: one expert's); where they are no one kernel, every
        expert runs on every row, gated (a decode step's few rows cost about their weights' reads)."""
        n_experts = self.experts.n_experts
        slots, positions, gates = static_assignments(routing, n_experts)  # (T, J) each
        if self.experts.static_grouped_applies(x):
            layout = dropless_rows(slots, positions, n_experts, x, gates)  # its rows' gates: (T*J,)
            return self._experts_combined(gather_rows(x, layout.rows), layout.gates, layout.rows, ends=layout.ends,
                                          computed=layout.computed, on_device=True)  # (T, D)
        ys = self.experts.every_row(x)  # (E, T, D)
        weights = expert_weights(slots, positions, gates, n_experts).t().to(ys.dtype)  # (E, T)
        return (weights.unsqueeze(-1) * ys).sum(0)  # (T, D)

    def _expert_choice(self, routing: ExpertChoiceRouting, rows: ExpertRows, xs: Tensor,
                       into: Tensor | None = None) -> Tensor:
        """Every expert takes exactly C tokens of each group: one static (E, G*C, D) batched matmul.
        xs (E*G*C, D): the chosen tokens, gathered expert-major by the router (ExpertChoiceRouter.route).
        into (B*S, D) or None: the rows are summed into it (combine_rows)."""
        n_experts, width = routing.positions.shape[1], xs.shape[1]
        gates = routing.gates.transpose(0, 1).reshape(-1)  # (E*G*C,), the order of rows.ids
        return self._experts_combined(xs.view(n_experts, -1, width), gates, rows, into=into)  # (B*S, D)

    def _causal_experts(self, x: Tensor, routing: CausalExpertRouting) -> Tensor:
        """x (T, D); expert e computes exactly the tokens its causal decision chose (variable counts)."""
        chosen = routing.mask.reshape(-1, self.experts.n_experts)  # (T, E) bool
        experts, tokens = chosen.t().nonzero(as_tuple=True)  # expert-major, token order within an expert
        counts = count_ids(experts, self.experts.n_experts)
        # No early return when nothing is chosen: under expert parallelism every rank must
        # still take part in the token exchange (the experts handle zero rows).
        rows = rows_by_slot(tokens, experts, self.experts.n_experts, x)
        gates = routing.gates.reshape(-1, self.experts.n_experts)[tokens, experts]  # (M,)
        return self._experts_combined(gather_rows(x, rows), gates, rows, counts)  # (T, D)

    def _token_choice(self, x: Tensor, routing: TokenChoiceRouting) -> Tensor:
        """x (T, D). With a capacity on torch: a static (E, C, D) layout; otherwise sorted by expert:
        dropless where Experts.by_ends applies, every assignment a row (static; on torch no host
        sync); elsewhere the computed rows only, their counts read on the host."""
        if self.experts.backend == "megablocks":
            return megablocks_token_choice(self.experts, x, routing)
        top_k = routing.slots.shape[1]
        if routing.capacity is None and self.experts.by_ends_applies(x):
            return self._dropless_by_ends(x, routing)
        gates = padded_gates(routing.gates)  # (T*k + 1,): a 0 gate for empty rows
        if routing.capacity is not None and self.experts.backend == "torch":
            if routing.layout is not None:  # built by the router's counting sort with the positions
                table, rows = routing.layout
            else:
                table = slot_table(routing.slots, routing.positions, self.experts.n_experts, routing.capacity)  # (E, C)
                rows = token_choice_rows(table, routing.slots, routing.positions, x)
            xs = gather_rows(x, rows).view(*table.shape, x.shape[1])  # (E, C, D)
            # index_select: its backward is one index_add (indexing's is a sort-based index_put)
            return self._experts_combined(xs, gates.index_select(0, table.reshape(-1)), rows)  # (T, D)
        table, counts = sort_by_expert(routing.slots, routing.positions, self.experts.n_experts)  # (M,), (E,)
        rows = rows_by_slot(table // top_k, table % top_k, top_k, x)  # a token's j-th choice: its slot j
        return self._experts_combined(gather_rows(x, rows), gates.index_select(0, table), rows, counts)  # (T, D)

    def _dropless_by_ends(self, x: Tensor, routing: TokenChoiceRouting) -> Tensor:
        """Dropless token choice on static rows: all T*k assignments, sorted by expert on the device,
        the no-op ones last, where the grouped GEMMs stop (ends[-1]); the inverse map leaves those
        rows out (or, without one, the experts zero them) and their gate is 0, so nothing past the
        end is ever read."""
        layout = dropless_rows(routing.slots, routing.positions, self.experts.n_experts, x, routing.gates)
        return self._experts_combined(gather_rows(x, layout.rows), layout.gates, layout.rows, ends=layout.ends,
                                      computed=layout.computed)  # (T, D)
