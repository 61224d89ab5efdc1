"""The routing sections: depth routing and its capacity schedule, Mixture-of-Recursions, the MoE FFN."""
from __future__ import annotations

from typing import Literal, Sequence, get_args

from pydantic import Field, field_validator, model_validator

from mode.config.sections import DEPTH_ROUTED_KINDS, Section


class CapacitySchedule(Section):
    """routing.capacity annealed from `start` to the target over `steps` optimizer steps, in
    `stages` equal stretches of constant capacity (each new capacity changes the routed k: a
    CUDA graph is captured again, a compiled model recompiles)."""

    start: float = Field(gt=0.0, le=1.0, description="the depth routers' capacity at step 0")
    steps: int = Field(gt=0, description="the step from which the capacity is routing.capacity")
    stages: int = Field(8, gt=0, description="how many capacities before the target; at most steps")

    @model_validator(mode="after")
    def _stages_fit(self) -> "CapacitySchedule":
        if self.stages > self.steps:
            raise ValueError(f"stages ({self.stages}) must not exceed steps ({self.steps})")
        return self


class RoutingConfig(Section):
    """Mixture-of-Depths routing (also the depth router of Staged MoDE)."""

    capacity: float | list[float] = Field(
        0.125,
        description=(
            "fraction of each sequence a depth-routed block processes, in (0, 1]: one value for every such block "
            "or a list of one per depth-routed block (mod, mode_staged), in layer order"
        ),
    )
    gate: Literal["identity", "sigmoid"] = Field(
        "sigmoid", description="g(r) multiplying the block update: the paper's raw score, or sigmoid"
    )
    random: bool = Field(
        False,
        description=(
            "stochastic-routing ablation: depth routers (mod, mode_staged's) choose tokens by random scores; "
            "expert routers are not affected"
        ),
    )
    router_bias: bool = False
    causal: Literal["none", "aux_loss", "predictor"] = Field(
        "none",
        description=(
            "causal routing decision for sampling (paper section 3.5): aux_loss trains the router's own "
            "logits with BCE towards top-k membership and samples with sigmoid(logit) > 0.5; predictor trains "
            "a small MLP on stop-gradient inputs and samples with its logit > 0; none: the model cannot sample"
        ),
    )
    causal_loss_weight: float = Field(
        0.01, ge=0.0, description="weight of the causal BCE term added to the aux loss (both methods)"
    )
    predictor_hidden: int = Field(128, gt=0, description="causal=predictor: hidden width of the MLP D -> hidden -> 1")
    capacity_schedule: CapacitySchedule | None = Field(
        None, description="anneal the depth routers' capacity from a start value to routing.capacity (conversion)"
    )

    @field_validator("capacity")
    @classmethod
    def _capacities_in_range(cls, value: float | list[float]) -> float | list[float]:
        values = value if isinstance(value, list) else [value]
        if not values:
            raise ValueError("an empty list: give one capacity per depth-routed block, or one number")
        for v in values:
            if not 0.0 < v <= 1.0:
                raise ValueError(f"capacity {v} is outside (0, 1]")
        return value

    def capacity_at(self, step: int) -> float | tuple[float, ...]:
        """The depth routers' capacity for optimizer step `step` (0-based): a number, or with a list of
        capacities a tuple, each layer annealed from the schedule's start to its own target."""
        if isinstance(self.capacity, (list, tuple)):
            return tuple(self._scheduled(target, step) for target in self.capacity)
        return self._scheduled(self.capacity, step)

    def _scheduled(self, target: float, step: int) -> float:
        plan = self.capacity_schedule
        if plan is None or step >= plan.steps:
            return target
        stage = step * plan.stages // plan.steps
        return plan.start + (target - plan.start) * stage / plan.stages

    def layer_capacities(self, kinds: Sequence[str], capacity: float | Sequence[float] | None = None) -> list[float]:
        """One capacity per layer of `kinds` (capacity, or routing.capacity where None): a list's values
        in order over the depth-routed layers (DEPTH_ROUTED_KINDS); the first value for the others."""
        capacity = self.capacity if capacity is None else capacity
        if not isinstance(capacity, (list, tuple)):
            return [capacity] * len(kinds)
        values, out = iter(capacity), []
        for kind in kinds:
            out.append(next(values) if kind in DEPTH_ROUTED_KINDS else capacity[0])
        return out


NoopKind = Literal["zero", "copy", "constant"]
NOOP_KINDS = get_args(NoopKind)


class MoRConfig(Section):
    """Mixture-of-Recursions (block kind mor): one weight-tied block applied up to `recursions`
    times, an expert-choice depth router before each (routing.gate, random, router_bias and
    causal apply to them as to a mod block's router)."""

    recursions: int = Field(3, ge=1, description="R: how many times the shared block may be applied")
    capacities: list[float] | None = Field(
        None,
        description=(
            "share of each sequence that recursion r processes, one per recursion, non-increasing in (0, 1] "
            "(recursion r chooses among the tokens recursion r-1 chose); null: (R - r) / R"
        ),
    )

    @model_validator(mode="after")
    def _capacities_nest(self) -> "MoRConfig":
        caps = self.capacities
        if caps is None:
            return self
        if len(caps) != self.recursions:
            raise ValueError(f"capacities has {len(caps)} values but recursions is {self.recursions}: give one per recursion")
        if not all(0.0 < c <= 1.0 for c in caps):
            raise ValueError(f"capacities {caps}: every value must be in (0, 1]")
        if any(later > earlier for earlier, later in zip(caps, caps[1:])):
            raise ValueError(
                f"capacities {caps} must not increase: recursion r chooses among the tokens recursion r-1 chose"
            )
        return self

    def capacity_list(self) -> list[float]:
        """Each recursion's share of the sequence: capacities, or (R - r) / R."""
        if self.capacities is not None:
            return list(self.capacities)
        return [(self.recursions - r) / self.recursions for r in range(self.recursions)]

    def router_capacities(self) -> list[float]:
        """Each recursion's router capacity: its share of the tokens still active (those recursion
        r-1 chose; recursion 0: the whole sequence), capacities[r] / capacities[r-1]."""
        caps = self.capacity_list()
        return [caps[0]] + [later / earlier for earlier, later in zip(caps, caps[1:])]


class MoEConfig(Section):
    """Mixture-of-Experts FFN (blocks moe, mode_staged, mode_integrated)."""

    n_experts: int = Field(8, gt=0, description="E real experts")
    n_noop: int = Field(0, ge=0, description="N no-op router slots: zero FFN update, no compute")
    noop_kind: NoopKind | list[NoopKind] = Field(
        "zero",
        description=(
            "what a no-op slot outputs, times its gate (MoE++): zero, copy (the token's FFN input) or constant "
            "(a learned vector); one kind for every slot or a list of n_noop kinds"
        ),
    )
    scheme: Literal["expert_choice", "token_choice"] = Field(
        "expert_choice", description="expert_choice: each expert takes its top-C tokens; token_choice: top_k slots per token"
    )
    top_k: int = Field(1, gt=0, description="token choice: slots each token picks")
    capacity_factor: float = Field(
        1.0, gt=0.0, description="expert choice: C = cf * T / (E+N) rounded, halves up; token choice: C = ceil(cf * T * top_k / (E+N))"
    )
    dropless: bool = Field(False, description="token choice: no capacity, no token is ever dropped")
    group_size: int = Field(1, gt=0, description="expert choice: sequences per routing group; must divide the batch")
    activation: Literal["swiglu", "gelu"] = "swiglu"
    d_expert: int | None = Field(None, gt=0, description="hidden width of one expert; default model.d_ff")
    lb_loss_weight: float = Field(0.01, ge=0.0, description="token choice: Switch load-balancing loss weight")
    z_loss_weight: float = Field(1e-3, ge=0.0, description="router z-loss weight (both schemes)")
    backend: Literal["torch", "grouped_gemm", "megablocks"] = Field(
        "torch", description="expert compute: torch (CPU and GPU), grouped_gemm or megablocks (CUDA only)"
    )
    renormalize: bool = Field(
        False, description="token choice: divide the top_k gates by their sum (Mixtral; Qwen2-MoE's norm_topk_prob)"
    )
    score: Literal["softmax", "sigmoid"] = Field(
        "softmax",
        description="token choice: the router's probabilities over the slots, a softmax or each slot's sigmoid (DeepSeek-V3)",
    )
    bias_update_rate: float = Field(
        0.0, ge=0.0,
        description=(
            "token choice: auxiliary-loss-free balancing (DeepSeek-V3); after each optimizer step every expert's "
            "selection bias moves by this rate towards the mean load; 0: no bias"
        ),
    )
    jitter: float = Field(
        0.0, ge=0.0, lt=1.0,
        description="token choice: in training, the router's input times uniform noise in [1 - jitter, 1 + jitter]",
    )
    shared_expert_d: int | None = Field(
        None, gt=0, description="hidden width of one SwiGLU expert every token goes through; null = none"
    )
    shared_expert_gate: bool = Field(
        False, description="scale the shared expert's output by sigmoid(x W_g), W_g (D, 1) (Qwen2-MoE)"
    )

    @model_validator(mode="after")
    def _consistent(self) -> "MoEConfig":
        if self.top_k > self.n_experts + self.n_noop:
            raise ValueError(
                f"top_k ({self.top_k}) exceeds the router's slots n_experts + n_noop ({self.n_experts + self.n_noop})"
            )
        if isinstance(self.noop_kind, list) and len(self.noop_kind) != self.n_noop:
            raise ValueError(
                f"noop_kind lists {len(self.noop_kind)} kinds {self.noop_kind} and n_noop is {self.n_noop}: give one "
                "kind per no-op slot, or one kind for all"
            )
        if self.n_noop == 0 and self._set_away_from_default("noop_kind") and self.noop_kind != []:
            raise ValueError(f"noop_kind ({self.noop_kind}) needs no-op slots: set n_noop")
        if self.scheme == "expert_choice" and self.dropless:
            raise ValueError("dropless applies to scheme token_choice only (expert choice never drops)")
        if self.scheme == "expert_choice" and self.top_k != 1:
            raise ValueError("top_k applies to scheme token_choice only; leave it at 1 for expert_choice")
        if self.scheme == "token_choice" and self.group_size != 1:
            # Token choice routes each token on its own; a capacity spans the whole micro-batch.
            raise ValueError("group_size applies to scheme expert_choice only; leave it at 1 for token_choice")
        if self.dropless and self._set_away_from_default("capacity_factor"):
            raise ValueError(
                f"capacity_factor ({self.capacity_factor}) has no effect with dropless=true (dropless token choice "
                "has no capacity): leave capacity_factor at 1.0 or set dropless=false"
            )
        if self.scheme == "expert_choice" and self.bias_update_rate > 0:
            raise ValueError(
                f"bias_update_rate ({self.bias_update_rate}) applies to scheme token_choice only (expert choice "
                "balances by construction); leave it at 0 for expert_choice"
            )
        if self.scheme == "expert_choice" and self.jitter > 0:
            raise ValueError(
                f"jitter ({self.jitter}) applies to scheme token_choice only (expert choice takes each expert's "
                "top-C tokens of a group, which noise on the router's input would reshuffle); leave it at 0"
            )
        if self.scheme == "expert_choice" and self.score != "softmax":
            raise ValueError(f"score={self.score} applies to scheme token_choice only (expert choice scores by softmax)")
        if self.scheme == "expert_choice" and self.renormalize:
            raise ValueError("renormalize applies to scheme token_choice only (expert choice's gates are per expert)")
        if self.shared_expert_gate and self.shared_expert_d is None:
            raise ValueError("shared_expert_gate needs a shared expert: set shared_expert_d")
        if self.scheme == "expert_choice" and self._set_away_from_default("lb_loss_weight"):
            raise ValueError(
                f"lb_loss_weight ({self.lb_loss_weight}) applies to scheme token_choice only (expert choice "
                "balances by construction and adds no load-balancing loss); leave it at 0.01 for expert_choice"
            )
        return self

    def noop_kinds(self) -> list[str]:
        """The kind of each of the n_noop no-op slots."""
        return list(self.noop_kind) if isinstance(self.noop_kind, list) else [self.noop_kind] * self.n_noop
