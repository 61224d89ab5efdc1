"""Analytic FLOP accounting: forward FLOPs per token for each block kind, and training FLOPs.

Conventions (the usual ones): a matmul of (m x k) by (k x n) costs 2*m*k*n FLOPs; norms,
activations, softmax and routing bookkeeping are not counted; the embedding lookup is free;
training costs 3x the forward (backward = 2x forward). Attention scores and values cost
2*D FLOPs each per (query, key) pair. With `causal=True` (the default) only the pairs a
causal kernel needs are counted, S(S+1)/2 per sequence; `causal=False` counts the full
S x S matrix, as a plain masked matmul implementation computes it.

Per token means: averaged over all S tokens of a sequence, so an MoD block processing k of S
tokens costs (k / S) * (its cost at sequence length k) + the router on all S tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

from mode.config import Config, ModelConfig
from mode.routing.primitives import capacity_to_k, token_choice_capacity


def attention_pairs_per_token(seq_len: int, causal: bool) -> float:
    """Average number of keys each query scores against."""
    return (seq_len + 1) / 2 if causal else float(seq_len)


def attention_flops(cfg: ModelConfig, seq_len: int, causal: bool) -> float:
    """Per token: q, k, v and output projections plus scores and weighted values. Grouped-query
    attention projects to n_kv_heads key and value heads; every query head scores and weighs."""
    d, hd = cfg.d_model, cfg.head_width
    query_width, kv_width = cfg.n_heads * hd, cfg.kv_heads * hd
    projections = 2 * d * (query_width + 2 * kv_width) + 2 * query_width * d
    scores_and_values = 2 * (2 * query_width) * attention_pairs_per_token(seq_len, causal)
    return projections + scores_and_values


def mlp_flops(d_model: int, d_ff: int, activation: str = "swiglu") -> float:
    """Per token: SwiGLU has three D x F matmuls, GELU two."""
    return (6 if activation == "swiglu" else 4) * d_model * d_ff


def router_flops(d_model: int, n_slots: int) -> float:
    return 2 * d_model * n_slots


def causal_predictor_flops(config: Config, n_out: int) -> float:
    """Per token: the causal-routing predictor (routing.causal=predictor), D -> hidden -> n_out.

    It runs on every token a router sees, at training and at sampling; method aux_loss
    reuses the router's own logits and costs nothing more.
    """
    if config.routing.causal != "predictor":
        return 0.0
    hidden = config.routing.predictor_hidden
    return 2 * config.model.d_model * hidden + 2 * hidden * n_out


def dense_block_flops(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
    return attention_flops(cfg, seq_len, causal) + mlp_flops(cfg.d_model, cfg.d_ff)


def mod_block_flops(config: Config, seq_len: int, causal: bool = True) -> float:
    k = capacity_to_k(seq_len, config.routing.capacity)
    inner = dense_block_flops(config.model, k, causal)
    return router_flops(config.model.d_model, 1) + causal_predictor_flops(config, 1) + (k / seq_len) * inner


def moe_ffn_flops(config: Config, tokens_per_group: int, tokens_per_batch: int) -> float:
    """Per token of an MoE FFN: router over all E+N slots, plus the real experts' work.

    Expert choice: each real expert takes exactly C tokens of a group, so the cost is exact.
    Token choice with a capacity: it routes a micro-batch's T tokens (tokens_per_batch), and each
    real expert is provisioned C = ceil(cf * T * top_k / (E + N)) rows (between 1 and T), E * C
    rows in all, which the padded layout (moe.backend torch) computes, empty rows included; so a
    capacity factor above 1 costs more and one below 1 less (the grouped backends compute only
    the rows kept, at most this). Dropless: every token's
    top_k assignments, of which a fraction E / (E + N) land on real experts under a balanced
    router (no-op slots cost nothing). A shared expert (a SwiGLU MLP of width moe.shared_expert_d)
    runs on every token, with its gate (D -> 1) where it has one.
    """
    moe = config.moe
    slots = moe.n_experts + moe.n_noop
    d_expert = moe.d_expert or config.model.d_ff
    expert = mlp_flops(config.model.d_model, d_expert, moe.activation)
    predictor = 0.0
    if moe.scheme == "expert_choice":
        capacity = expert_choice_capacity(config, tokens_per_group)
        assignments_per_token = moe.n_experts * capacity / tokens_per_group
        predictor = causal_predictor_flops(config, moe.n_experts)  # token choice needs no causal decision
    elif moe.dropless:
        assignments_per_token = moe.top_k * moe.n_experts / slots
    else:  # E * C / T, C rounded up as the router rounds it
        capacity = token_choice_capacity(tokens_per_batch, slots, moe.top_k, moe.capacity_factor)
        assignments_per_token = moe.n_experts * capacity / tokens_per_batch
    return router_flops(config.model.d_model, slots) + predictor + assignments_per_token * expert + shared_expert_flops(config)


def shared_expert_flops(config: Config) -> float:
    """Per token: the MoE's shared expert (moe.shared_expert_d) and its sigmoid gate; 0 without one."""
    moe, d = config.moe, config.model.d_model
    if moe.shared_expert_d is None:
        return 0.0
    return mlp_flops(d, moe.shared_expert_d) + (router_flops(d, 1) if moe.shared_expert_gate else 0.0)


def expert_choice_capacity(config: Config, tokens_per_group: int) -> int:
    moe = config.moe
    return capacity_to_k(tokens_per_group, moe.capacity_factor / (moe.n_experts + moe.n_noop))


def block_flops(kind: str, config: Config, seq_len: int, causal: bool = True) -> float:
    """Forward FLOPs per token of one block of the given kind at sequence length seq_len.

    An MoE FFN's token-choice capacity depends on how many tokens it routes at once: a
    micro-batch of train.batch_size sequences (each process its own under data parallelism).
    """
    model = config.model
    if kind == "dense":
        return dense_block_flops(model, seq_len, causal)
    if kind == "mod":
        return mod_block_flops(config, seq_len, causal)
    if kind in ("moe", "mode_integrated"):
        return attention_flops(model, seq_len, causal) + _moe_ffn_flops_at(config, seq_len)
    if kind == "mode_staged":
        k = capacity_to_k(seq_len, config.routing.capacity)
        inner = attention_flops(model, k, causal) + _moe_ffn_flops_at(config, k)  # the MoE sees k tokens a sequence
        return router_flops(model.d_model, 1) + causal_predictor_flops(config, 1) + (k / seq_len) * inner
    if kind == "mor":
        return mor_block_flops(config, seq_len, causal)
    raise ValueError(f"no FLOP formula for block kind {kind!r}")


def recursion_tokens(seq_len: int, router_capacities: list[float]) -> list[int]:
    """Tokens each recursion of a mor block processes per sequence under top-k routing:
    k_r = capacity_to_k(k_{r-1}, router_capacities[r]), k_{-1} = seq_len (MoRConfig.router_capacities)."""
    ks, active = [], seq_len
    for capacity in router_capacities:
        active = capacity_to_k(active, capacity)
        ks.append(active)
    return ks


def mor_block_flops(config: Config, seq_len: int, causal: bool = True) -> float:
    """Per token of a Mixture-of-Recursions block: each recursion r's router (and causal predictor)
    on the k_{r-1} tokens still active, and the shared block on its k_r chosen tokens (attention
    among those k_r): sum_r (k_{r-1} * router + k_r * block(k_r)) / S."""
    d = config.model.d_model
    router = router_flops(d, 1) + causal_predictor_flops(config, 1)
    total, active = 0.0, seq_len
    for k in recursion_tokens(seq_len, config.mor.router_capacities()):
        total += active * router + k * dense_block_flops(config.model, k, causal)
        active = k
    return total / seq_len


def _moe_ffn_flops_at(config: Config, tokens_per_sequence: int) -> float:
    """moe_ffn_flops where each sequence brings tokens_per_sequence tokens to the FFN."""
    group = tokens_per_sequence * config.moe.group_size
    return moe_ffn_flops(config, group, tokens_per_sequence * config.train.batch_size)


@dataclass
class FlopReport:
    per_block: list[float]  # forward FLOPs per token, one per block
    lm_head: float

    @property
    def forward_per_token(self) -> float:
        return sum(self.per_block) + self.lm_head

    @property
    def train_per_token(self) -> float:
        return 3 * self.forward_per_token


def model_flops(config: Config, seq_len: int | None = None, causal: bool = True) -> FlopReport:
    seq = seq_len or config.data.seq_len
    kinds = config.model.block_kinds()
    capacities = config.routing.layer_capacities(kinds)  # each depth-routed block at its own capacity
    per_block = [block_flops(kind, config.at_capacity(c), seq, causal) for kind, c in zip(kinds, capacities)]
    return FlopReport(per_block, lm_head=2 * config.model.d_model * config.model.vocab_size)


def train_step_flops(config: Config, world_size: int = 1, step: int | None = None) -> float:
    """FLOPs of one optimizer step: 3 x forward over every token of every micro-batch; at step's
    scheduled capacity (routing.capacity_schedule) when step is given, else at routing.capacity."""
    t = config.train
    tokens = t.batch_size * t.grad_accum * config.data.seq_len * world_size
    if step is not None:
        config = config.at_capacity(config.routing.capacity_at(step))
    return model_flops(config).train_per_token * tokens
