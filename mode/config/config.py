"""Config: every section, and the rules that span sections."""
from __future__ import annotations

from typing import Any, Sequence

from pydantic import Field, model_validator

from mode.config.routing import MoEConfig, MoRConfig, RoutingConfig
from mode.config.sections import DEPTH_ROUTED_KINDS, DataConfig, ModelConfig, ParallelConfig, Section, TrainConfig


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
