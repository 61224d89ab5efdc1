"""The config sections' base, the block kinds, and the model, data, train and parallel sections."""
from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationInfo, field_validator, model_validator

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
            "and replayed (GPU; static shapes: token choice on moe.backend=torch, dropless only where its sync-free "
            "layout runs: one process on an H100/H200-class GPU, bf16; through launch/train.py under ZeRO 0, with "
            "expert parallelism for true only). auto: wherever they can run (on a GPU, not compiled, no layer "
            "reading its routing on the host, no expert parallelism), plain eager elsewhere; "
            "true: required (an error where they cannot run); false: plain eager"
        ),
    )
    bf16_weights: StrictBool | Literal["auto"] = Field(
        "auto",
        description=(
            "hold the attention, FFN and expert matrices in bf16 while training under bf16 autocast, each with a "
            "float32 master that AdamW steps and rounds into it (no per-step casts of the weights or of their "
            "gradients; the same values; with grad_accum > 1 the micro-batches' bf16 gradients are summed in "
            "float32, as float32 weights sum them). auto: wherever it can run (on a GPU: python -m mode.train, or "
            "launch/train.py under ZeRO 0); true: required (an error where it cannot "
            "run); false: float32 weights. "
            "Checkpoints hold the float32 masters either way"
        ),
    )
    overlap_update: StrictBool | Literal["auto"] = Field(
        False,
        description=(
            "with bf16 weights under the eager CUDA graphs: run each step's update of the bf16 matrices inside "
            "the next step's forward, block by block on a side stream beside its kernels, instead of after the "
            "backward (the same arithmetic: the same weights bit for bit). false (default): the update runs in "
            "the step; auto: wherever it can run; true: required (an error where it cannot). Off by default: "
            "on an H200 it changed a step by -1.1% to +1.2%, run to run (docs/training.md)"
        ),
    )
    attention_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = Field(
        "auto",
        description=(
            "the scaled-dot-product attention kernel of the training and evaluation forward: auto (PyTorch "
            "chooses per call), or flash, cudnn, efficient (memory-efficient) or math, that kernel alone: an error "
            "at start-up where it cannot run the model on the run's device and dtype (cudnn and efficient need "
            "CUDA). Sampling's cached attention keeps its own kernels"
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
    reduce_bucket_mb: float = Field(
        32.0, ge=0, description="with bf16 weights (ZeRO 0): gradients all-reduced in buckets of this many MiB, "
        "each started as the backward completes it, beside the rest of the backward; 0: all after the backward"
    )

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
