"""Experiment configuration: strict, typed, loaded from YAML with command-line overrides.

Every section forbids unknown keys, so a typo is an error that names its path
(`model.n_layer: extra inputs are not permitted`) instead of a silently ignored setting.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Callable, Literal, Sequence, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

BLOCK_KINDS = ("dense", "mod", "moe", "mode_staged", "mode_integrated", "mor")
BlockKind = Literal["dense", "mod", "moe", "mode_staged", "mode_integrated", "mor"]
DEFAULT_BLOCK_PATTERN = ("dense", "mod")
EXPERT_KINDS = ("moe", "mode_staged", "mode_integrated")  # blocks with an MoE FFN
DEPTH_ROUTED_KINDS = ("mod", "mode_staged")  # blocks with a depth router (routing.capacity, gate, random)
# torch.manual_seed takes [-2**63, 2**64) (a negative seed aliases seed + 2**64); train.seed is kept
# below 2**63, so that offsets from it (bench/scaling.py: seed + 1 + rank) stay in torch's range.
SEED_LIMIT = 2**63


def seed_problem(seed: int) -> str | None:
    """Why seed cannot seed a run or a sampling (train.seed, mode.generate --seed), or None."""
    return None if 0 <= seed < SEED_LIMIT else "must be between 0 and 2**63 - 1"


class ConfigError(ValueError):
    """A configuration problem; the message names the file and the field path."""


class Section(BaseModel):
    # allow_inf_nan=False: an infinite learning rate or rope base trains to NaN; refused at load instead.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_number(cls, value: Any, info: ValidationInfo) -> Any:
        """Lax validation would read YAML's true/false/yes/no as 1/0 for a number field."""
        annotation = cls.model_fields[info.field_name].annotation
        kinds = set(get_args(annotation)) or {annotation}
        if isinstance(value, bool) and kinds & {int, float} and bool not in kinds:
            raise ValueError("expected a number, not a boolean")
        return value

    def _set_away_from_default(self, name: str) -> bool:
        """Whether field `name` was given (model_fields_set) with a value other than its default. A run's
        saved config.yaml gives every field, defaults included, so "given" alone would refuse saved runs."""
        default = type(self).model_fields[name].get_default(call_default_factory=True)
        return name in self.model_fields_set and getattr(self, name) != default


class RopeScaling(Section):
    """Llama-3 rotary scaling: wavelengths longer than original_max_seq_len / low_freq_factor are
    stretched by factor, those shorter than original_max_seq_len / high_freq_factor kept, and the
    band between blended linearly (in original_max_seq_len / wavelength). Defaults: Llama 3.1's."""

    factor: float = Field(8.0, gt=0, description="how much the long wavelengths are stretched")
    low_freq_factor: float = Field(1.0, gt=0)
    high_freq_factor: float = Field(4.0, gt=0)
    original_max_seq_len: int = Field(8192, gt=0, description="the context length the model was pretrained at")

    @model_validator(mode="after")
    def _band(self) -> "RopeScaling":
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor ({self.low_freq_factor}): "
                "they bound the band of wavelengths that is blended"
            )
        return self


class ModelConfig(Section):
    vocab_size: int = Field(256, gt=0, description="256 for the byte-level tokenizer")
    d_model: int = Field(128, gt=0)
    n_heads: int = Field(4, gt=0)
    n_kv_heads: int | None = Field(
        None, gt=0, description="key/value heads (grouped-query attention); must divide n_heads; default n_heads"
    )
    head_dim: int | None = Field(None, gt=0, description="width of one attention head; default d_model / n_heads")
    qkv_bias: bool = Field(False, description="biases on the query, key and value projections (Qwen2)")
    n_layers: int = Field(4, gt=0)
    d_ff: int = Field(384, gt=0, description="hidden width of the SwiGLU MLP")
    max_seq_len: int = Field(256, gt=0, description="longest sequence; sizes the rotary table")
    block_pattern: list[BlockKind] = Field(
        default_factory=lambda: list(DEFAULT_BLOCK_PATTERN),
        min_length=1,
        description="kinds of consecutive blocks, repeated until n_layers blocks exist",
    )
    rope_base: float = Field(10000.0, gt=0)
    rope_scaling: RopeScaling | None = Field(None, description="Llama-3 rotary scaling; none: plain rotary")
    norm_eps: float = Field(1e-6, gt=0)
    tie_embeddings: bool = False
    init_std: float = Field(0.02, gt=0)

    @model_validator(mode="after")
    def _pattern_fits_the_layers(self) -> "ModelConfig":
        # The default [dense, mod] is cut to [dense] by n_layers=1, as before.
        if len(self.block_pattern) > self.n_layers and self._set_away_from_default("block_pattern"):
            # block_kinds() cuts the pattern at n_layers: the kinds past it would never be built, while
            # the moe / routing sections and the saved config would still describe them.
            raise ValueError(
                f"block_pattern has {len(self.block_pattern)} kinds {self.block_pattern} but n_layers is "
                f"{self.n_layers}: the kinds past n_layers would never be built; shorten block_pattern or raise n_layers"
            )
        return self

    @model_validator(mode="after")
    def _heads_divide_width(self) -> "ModelConfig":
        if self.head_dim is None:
            if self.d_model % self.n_heads != 0:
                raise ValueError(
                    f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
                )
            if (self.d_model // self.n_heads) % 2 != 0:
                raise ValueError("head width d_model / n_heads must be even for rotary embeddings")
        elif self.head_dim % 2 != 0:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads}): each key/value head "
                "serves a group of query heads"
            )
        return self

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_heads, or n_heads where it is not set."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_width(self) -> int:
        """Width of one attention head: head_dim, or d_model / n_heads where it is not set."""
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim

    def block_kinds(self) -> list[str]:
        """The kind of every layer, the pattern repeated to n_layers."""
        return [self.block_pattern[i % len(self.block_pattern)] for i in range(self.n_layers)]

    def has_experts(self) -> bool:
        """Whether some block built has an MoE FFN (moe, mode_staged, mode_integrated)."""
        return any(kind in EXPERT_KINDS for kind in self.block_kinds())

    def has_depth_router(self) -> bool:
        """Whether some block built routes tokens by depth (mod, mode_staged)."""
        return any(kind in DEPTH_ROUTED_KINDS for kind in self.block_kinds())


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


class DataConfig(Section):
    source: Literal["stdlib", "text", "tokens"] = Field(
        "stdlib",
        description=(
            "stdlib: the running Python's standard library source; text: a file or folder; tokens: a .bin, or a "
            "folder python -m mode.data prepare wrote"
        ),
    )
    path: str | None = Field(None, description="file or folder for source=text or source=tokens")
    # A prepared folder's meta.json sets token_dtype and val_fraction (and model.vocab_size) when the config loads.
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    val_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    seq_len: int = Field(256, gt=1)

    @model_validator(mode="after")
    def _path_when_needed(self) -> "DataConfig":
        if self.source in ("text", "tokens") and not self.path:
            raise ValueError(f"data.path is required when data.source is '{self.source}'")
        if self.source == "stdlib" and self.path:
            raise ValueError(
                f"data.path ({self.path}) is set but data.source is 'stdlib', which reads no path: "
                "set data.source=text (a file or folder) or data.source=tokens (a .bin)"
            )
        return self


class TrainConfig(Section):
    seed: int = Field(0, description="seeds the model's initialisation, the data order and random routing")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    batch_size: int = Field(16, gt=0, description="sequences per micro-batch")
    grad_accum: int = Field(1, gt=0)
    max_steps: int = Field(200, gt=0)
    flops_budget: float | None = Field(
        None, gt=0,
        description=(
            "train to this many training FLOPs (3 x forward, every process's tokens) instead of max_steps: "
            "max_steps becomes the number of whole steps within it (isoFLOP comparisons)"
        ),
    )
    lr: float = Field(3e-3, gt=0)
    min_lr: float = Field(3e-4, ge=0)
    warmup_steps: int = Field(20, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm; 0 disables")
    eval_interval: int = Field(50, gt=0)
    eval_batches: int = Field(8, gt=0)
    log_interval: int = Field(10, gt=0)
    checkpoint_interval: int = Field(100, gt=0)
    # min_length: an empty path is the current folder (an unset $OUT in --train.out_dir=$OUT)
    out_dir: str = Field("runs/default", min_length=1, description="the run folder")
    compile: bool = False
    compile_mode: Literal["default", "reduce-overhead"] = Field(
        "default",
        description=(
            "torch.compile's mode with compile=true; reduce-overhead replays each micro-batch as CUDA "
            "graphs (one process, GPU), which routed layers' many small kernels gain most from"
        ),
    )
    cuda_graphs: StrictBool | Literal["auto"] = Field(
        "auto",
        description=(
            "eager CUDA graphs, without torch.compile: each micro-batch's forward and backward captured once "
            "and replayed (one process, GPU; static shapes: token choice on moe.backend=torch, dropless only where "
            "its sync-free layout runs: H100/H200-class GPUs, bf16). auto: wherever they can run (python -m "
            "mode.train on a GPU, not compiled, no layer reading its routing on the host), plain eager elsewhere; "
            "true: required (an error where they cannot run); false: plain eager"
        ),
    )
    progress: bool = True
    tensorboard: bool = Field(
        False,
        description=(
            "also write every metric of metrics.jsonl as TensorBoard event files in <out_dir>/tensorboard/ "
            "(needs the tensorboard package: pip install -e .[track])"
        ),
    )
    init_from: str | None = Field(
        None, min_length=1,
        description="a checkpoint (run folder or checkpoint.pt) whose weights start this new run; same model section, "
                    "except block_pattern: its dense / MoE layers are then converted (docs/huggingface.md)",
    )
    trainable: list[str] = Field(
        default_factory=lambda: ["all"], min_length=1,
        description="the parameters training updates: all, routers (every router and causal predictor), or "
                    "fnmatch patterns over parameter names (blocks.*.attn.*); the rest stay bit-identical",
    )

    @field_validator("trainable", mode="before")
    @classmethod
    def _trainable_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("seed")
    @classmethod
    def _seed_in_range(cls, seed: int) -> int:
        # checked here: torch.manual_seed would fail later with "Overflow when unpacking long long"
        problem = seed_problem(seed)
        if problem is not None:
            raise ValueError(problem)
        return seed

    @model_validator(mode="after")
    def _lr_order(self) -> "TrainConfig":
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        if self.compile_mode != "default" and not self.compile:
            raise ValueError(f"compile_mode={self.compile_mode!r} needs compile=true")
        if self.cuda_graphs is True and self.compile:
            raise ValueError(
                "cuda_graphs=true graphs the eager model; with compile=true use compile_mode=reduce-overhead instead"
            )
        return self


class ParallelConfig(Section):
    """Multi-process training through DeepSpeed (launch/train.py); one process ignores it."""

    zero_stage: int = Field(0, description="DeepSpeed ZeRO stage: 0, 1 or 2")
    expert_parallel: int = Field(
        1, ge=1, description="ep: processes each MoE layer's experts are sharded over; divides moe.n_experts and the world size"
    )
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="auto: nccl on CUDA, gloo on CPU")

    @field_validator("zero_stage")
    @classmethod
    def _zero_stage(cls, stage: int) -> int:
        if stage == 3:
            raise ValueError(
                "ZeRO stage 3 is not supported (DeepSpeed refuses ZeRO-3 with MoE layers); use 0, 1 or 2"
            )
        if stage not in (0, 1, 2):
            raise ValueError("must be 0, 1 or 2")
        return stage


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    moe: MoEConfig = Field(default_factory=MoEConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    mor: MoRConfig = Field(default_factory=MoRConfig)

    @model_validator(mode="after")
    def _sequence_fits(self) -> "Config":
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"data.seq_len ({self.data.seq_len}) exceeds model.max_seq_len ({self.model.max_seq_len})"
            )
        if "mode_integrated" in self.model.block_kinds() and self.moe.n_noop == 0:
            raise ValueError(
                "moe.n_noop must be > 0 when model.block_pattern has mode_integrated "
                "(its FFN routes some tokens to no-op experts)"
            )
        return self

    @model_validator(mode="after")
    def _a_capacity_per_routed_layer(self) -> "Config":
        capacity, kinds = self.routing.capacity, self.model.block_kinds()
        routed = sum(kind in DEPTH_ROUTED_KINDS for kind in kinds)
        if isinstance(capacity, list) and len(capacity) != routed:
            raise ValueError(
                f"routing.capacity lists {len(capacity)} capacities and model.block_pattern builds {routed} "
                f"depth-routed blocks (mod, mode_staged) of {kinds}: give one per depth-routed block, or one number"
            )
        return self

    @model_validator(mode="after")
    def _schedule_reaches_a_router(self) -> "Config":
        if self.routing.capacity_schedule is not None and not self.model.has_depth_router():
            raise ValueError(
                f"routing.capacity_schedule anneals depth routers' capacity (mod and mode_staged blocks), and "
                f"model.block_pattern {self.model.block_pattern} has none"
            )
        return self

    @model_validator(mode="after")
    def _schedule_skips_recursions(self) -> "Config":
        """A capacity schedule sets the depth routers of mod and mode_staged blocks; a mor block's
        routers each have their own capacity (mor.capacities)."""
        if self.routing.capacity_schedule is not None and "mor" in self.model.block_kinds():
            raise ValueError(
                "routing.capacity_schedule does not apply to mor blocks (their routers take mor.capacities): "
                "remove it or the mor blocks"
            )
        return self

    def at_capacity(self, capacity: float | Sequence[float]) -> "Config":
        """This config with routing.capacity set to capacity (a scheduled step's FLOPs; a block's own)."""
        return self.model_copy(update={"routing": self.routing.model_copy(update={"capacity": capacity})})

    @model_validator(mode="after")
    def _random_routing_reaches_a_router(self) -> "Config":
        """routing.random replaces a depth router's scores; expert routers (moe, mode_integrated, and
        mode_staged's inner MoE) ignore it, so a model without a depth router would train as learned."""
        if not self.routing.random:
            return self
        if not self.model.has_depth_router():
            raise ValueError(
                f"routing.random=true changes only depth routers' choices (mod and mode_staged blocks), and "
                f"model.block_pattern {self.model.block_pattern} has none: expert routers are not affected, "
                "so the run would train as learned routing"
            )
        if self.routing.causal != "none":
            # The causal BCE would be trained towards membership of a random top-k, which no router can
            # predict, and sampling would follow a decision training never routed by.
            raise ValueError(
                f"routing.random=true with routing.causal={self.routing.causal}: a random-routed model has no "
                "choice a causal decision could learn, and cannot be sampled; set routing.causal=none"
            )
        return self

    @model_validator(mode="after")
    def _graphs_need_static_shapes(self) -> "Config":
        """A CUDA graph replays fixed shapes with no host synchronisation: token choice on a grouped
        backend sizes its groups on the host, from the routing. (Dropless on torch has a sync-free
        layout on some GPUs: the trainer checks that on its device, MoEFFN.syncs_with_host.)"""
        m = self.moe
        if self.train.cuda_graphs is True and self.model.has_experts() and m.scheme == "token_choice" and m.backend != "torch":
            raise ValueError(
                "train.cuda_graphs needs static shapes: token choice runs on moe.backend=torch under CUDA "
                f"graphs (got backend={m.backend})"
            )
        return self

    @model_validator(mode="after")
    def _groups_fill_the_batch(self) -> "Config":
        """Expert choice routes groups of group_size sequences of one micro-batch (training and evaluation)."""
        m, batch = self.moe, self.train.batch_size
        if self.model.has_experts() and m.scheme == "expert_choice" and batch % m.group_size != 0:
            raise ValueError(
                f"moe.group_size ({m.group_size}) must divide train.batch_size ({batch}): expert choice "
                "routes groups of group_size sequences of each micro-batch"
            )
        return self

    @model_validator(mode="after")
    def _experts_shard(self) -> "Config":
        if self.parallel.expert_parallel > 1 and not self.model.has_experts():
            raise ValueError(
                f"parallel.expert_parallel ({self.parallel.expert_parallel}) shards experts, and model.block_pattern "
                f"{self.model.block_pattern} has none (no moe, mode_staged or mode_integrated block): set it to 1"
            )
        if self.model.has_experts() and self.moe.n_experts % self.parallel.expert_parallel != 0:
            raise ValueError(
                f"parallel.expert_parallel ({self.parallel.expert_parallel}) must divide moe.n_experts "
                f"({self.moe.n_experts}): each process holds n_experts / expert_parallel experts"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def _format_errors(err: ValidationError, source: str, overrides: Sequence[str] = ()) -> str:
    """One line per error: the field path, what is wrong, the value given (a single value, not a
    whole section a cross-field check saw), and the command-line override that set it, if one did."""
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            line = f"  {path}: unknown key{_nesting_hint(e['loc'])}"
        else:
            message = e["msg"].removeprefix("Value error, ")
            # a check across sections (at the root) names its fields in its message
            line = f"  {message}" if path == "<root>" else f"  {path}: {message}"
            if not isinstance(e.get("input"), dict):
                line += f" (got {e.get('input')!r})"
        given = [o for o in overrides if _names_the_error(_override_key(o), path, line, e["type"])]
        lines.append(line + (f" [from the command line: {given[-1]}]" if given else ""))
    return "\n".join(lines)


def _nesting_hint(loc: tuple[Any, ...]) -> str:
    """A dotted key at a file's top level (`model.d_model: 64`) names a field that exists: say to nest it."""
    if len(loc) != 1 or "." not in str(loc[0]):
        return ""
    section, field = str(loc[0]).split(".", 1)
    return f" (a dotted key is not a path in a file: write it nested, {section}: {{{field}: ...}})"


def _names_the_error(key: str, path: str, line: str, kind: str) -> bool:
    """Whether the override of `key` set what an error at `path` reports: the field itself, a field the
    line names, or a field inside it (an unknown section `--trian.lr` fails as `trian`; a check of the
    section `train` names `min_lr` in its message)."""
    if key == path or key in line:
        return True
    inside = key.startswith(f"{path}.") or path == "<root>"
    return inside and (kind == "extra_forbidden" or key.rsplit(".", 1)[-1] in line)


def _override_key(text: str) -> str:
    return text.removeprefix("--").split("=", 1)[0]


def _field_path(key: str) -> list[str]:
    """'train..lr' -> ['train', 'lr']: the path a dotted key names (empty parts dropped)."""
    return [part for part in key.split(".") if part]


def override_field(text: str) -> str:
    """'--train..lr=3e-4' or 'train.lr' -> 'train.lr': the field an override (or a bare key) sets."""
    return ".".join(_field_path(_override_key(text)))


def parse_override(text: str) -> tuple[list[str], Any]:
    """'--train.lr=3e-4' -> (['train', 'lr'], 0.0003); values are parsed as YAML (load_yaml)."""
    body = text[2:] if text.startswith("--") else text
    if "=" not in body:
        raise ConfigError(f"override {text!r} must look like --section.field=value")
    key, raw = body.split("=", 1)
    path = _field_path(key)
    if len(path) < 2:
        raise ConfigError(f"override {text!r} must name a section and a field, e.g. --train.lr=3e-4")
    try:
        value = load_yaml(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML: {e}") from e
    return path, value


def apply_overrides(raw: dict[str, Any], overrides: list[str], source: str = "the config") -> dict[str, Any]:
    out = copy.deepcopy(raw)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: '{part}' in {source} is not a section (a mapping of fields)")
            node = child
        node[path[-1]] = value
    return out


def _require_mapping(raw: Any, source: str) -> None:
    if not isinstance(raw, dict):
        raise ConfigError(f"invalid config {source}: the top level must be a mapping of sections")


def config_from_dict(raw: dict[str, Any], source: str = "<dict>", overrides: Sequence[str] = ()) -> Config:
    _require_mapping(raw, source)
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source, overrides)) from None


class _StrictLoader(yaml.SafeLoader):
    """yaml.safe_load, except that a key given twice in one mapping is an error (YAML itself keeps the
    last one silently, and a second `train:` section would drop the whole first one), and that numbers
    and booleans follow YAML 1.2 (see _yaml_12_numbers) instead of PyYAML's YAML 1.1."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` merges may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (lines {seen[key]} and {line}); YAML would keep the last",
                    key_node.start_mark,
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


_INT, _FLOAT, _BOOL = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:bool"


def _yaml_12_numbers(loader: type[yaml.SafeLoader]) -> None:
    """Plain scalars become numbers and booleans by YAML 1.2's core schema, not PyYAML's YAML 1.1, whose
    rules turned written values silently into others: `seed: 010` read as 8 (octal), `1:30` as 90
    (base 60), and `1e-3` stayed text. Here an integer is decimal as written (leading zeros too), or
    0o / 0x; a float has a point or an exponent (1e-3), or is .inf / .nan; true and false are the
    booleans. Anything else is text, which the config's fields then check (`max_steps: 1:30` is an
    error naming the field). What yaml.safe_dump writes (saved runs' config.yaml) reads back the same."""
    loader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_INT, _FLOAT, _BOOL)]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    loader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
    # Integers before floats: a resolver list is tried in order, and "10" also has a float's form.
    loader.add_implicit_resolver(_INT, re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789"))
    loader.add_implicit_resolver(
        _FLOAT,
        re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
        list("-+.0123456789"),
    )
    loader.add_constructor(_INT, _construct_yaml_12_int)


def _construct_yaml_12_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    if text.startswith(("0o", "0x")):
        return int(text[2:], 8 if text[1] == "o" else 16)
    return int(text, 10)


_yaml_12_numbers(_StrictLoader)


def load_yaml(text: str) -> Any:
    """YAML text (a config file, an override's or a sweep's value) as the configs read it: _StrictLoader."""
    return yaml.load(text, Loader=_StrictLoader)


def read_yaml_file(path: Path) -> Any:
    """A YAML file's contents, strictly (_StrictLoader); unreadable text or bad YAML is a ConfigError naming it."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text ({e})") from None
    try:
        return load_yaml(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config (or the defaults when path is None) and apply --a.b=value overrides; data.path at
    a prepared token folder sets model.vocab_size, data.token_dtype and data.val_fraction (mode.data.meta)."""
    raw: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        p = Path(path)
        source = str(p)
        if p.is_dir():
            raise ConfigError(f"config file {p} is a folder; give a YAML file (see configs/)")
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        raw = read_yaml_file(p) or {}
    _require_mapping(raw, source)  # before the overrides go into it
    # A section whose keys are all commented out reads as null: an empty section, all defaults.
    raw = {name: {} if value is None else value for name, value in raw.items()}
    raw = apply_overrides(raw, overrides or [], source)
    config = config_from_dict(raw, source, overrides or [])
    from mode.data.meta import apply_metadata  # here, not above: mode.data imports this module

    apply_metadata(config)  # a prepared token folder's vocabulary, dtype and split
    return config


def flat_fields(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'model': {'d_model': 64}} -> {'model.d_model': 64}; lists stay whole values."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_fields(value, f"{name}."))
        else:
            out[name] = value
    return out


def field_differences(saved: dict[str, Any], config: Config, keep: Callable[[str], bool] = lambda name: True) -> list[str]:
    """The fields (keep(name) true) where a saved config dict and config differ, each as
    "model.d_ff (64 there, 96 here)". Fields the saved dict lacks (an older version's) are not compared."""
    there, here = flat_fields(saved), flat_fields(config.to_dict())
    return [f"{name} ({there[name]!r} there, {here.get(name)!r} here)"
            for name in there if keep(name) and there[name] != here.get(name)]


def config_text(config: Config) -> str:
    """The YAML a run folder's config.yaml holds."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False)


def save_config(config: Config, path: str | Path) -> None:
    from mode.utils import atomic_write_text

    atomic_write_text(Path(path), config_text(config))
