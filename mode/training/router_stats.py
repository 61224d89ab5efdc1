"""Router statistics: read from the model's outputs in one host copy, pooled over micro-batches
and processes, and the position histograms of chosen tokens."""
from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor

from mode.model import ModelOutput
from mode.routing import DepthRouting, ExpertChoiceRouting, Routing, token_mask

POSITION_BINS = 16


# ----------------------------------------------------------------------------- router statistics
class HostCopy:
    """Tensors' values on their way to the host, in one transfer.

    On CUDA the copy is queued behind the work that computes the values (into pinned memory,
    without waiting) and values() waits for that copy alone, not for work queued after it: the
    training loop reads a step's losses after it has queued the next step, so the GPU never runs
    dry while the host waits. One transfer instead of one per value: a step reads its losses and
    some ten statistics per routed layer, and each separate read would stall the queue again.
    """

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        self.sizes = [t.numel() for t in tensors]
        flat = torch.cat([t.detach().float().reshape(-1) for t in tensors])
        self.done: torch.cuda.Event | None = None
        if flat.is_cuda:
            self.host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self.host.copy_(flat, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record(torch.cuda.current_stream(flat.device))
        else:
            self.host = flat

    def values(self) -> list[list[float]]:
        if self.done is not None:
            self.done.synchronize()
        return split_list(self.host.tolist(), self.sizes)


def split_list(flat: list[float], sizes: Sequence[int]) -> list[list[float]]:
    """flat cut into consecutive pieces of the given sizes."""
    out, start = [], 0
    for size in sizes:
        out.append(flat[start : start + size])
        start += size
    return out


def summary_tensors(routing: Routing) -> dict[str, Tensor]:
    """What a step reports for one router, still on the device: the fraction of tokens
    processed, the gate's mean and spread, then the router's own stats."""
    gates = routing.gates.detach().float()
    processed = routing.stats["processed"] if "processed" in routing.stats else processed_fraction(routing)
    # The population spread (no Bessel correction), so that several ranks' spreads pool exactly.
    out = {"processed": processed, "gate_mean": gates.mean(), "gate_std": gates.std(correction=0)}
    for name, value in routing.stats.items():
        out.setdefault(name, value)
    return out


def summaries_from(tensors: dict[str, dict[str, Tensor]], values: list[list[float]]) -> dict[str, dict[str, Any]]:
    """Per layer and statistic: a float, or a list rounded to 5 decimals (tokens per expert), in the
    order of `tensors`; values are HostCopy.values() of those tensors."""
    out: dict[str, dict[str, Any]] = {}
    entries = ((layer, name, t) for layer, stats in tensors.items() for name, t in stats.items())
    for (layer, name, t), vals in zip(entries, values, strict=True):
        out.setdefault(layer, {})[name] = vals[0] if t.numel() == 1 else [round(v, 5) for v in vals]
    return out


# Statistics that count tokens (summed over ranks); every other one is a mean over tokens.
COUNT_STATS = ("tokens_per_expert", "expert_load")


def pool_summaries(summaries: list[dict[str, dict[str, Any]]], mean_over_ranks: Callable[[list[float]], list[float]],
                   world_size: int) -> list[dict[str, dict[str, Any]]]:
    """Each rank's per-micro-batch statistics -> those of the whole micro-batch over all ranks.

    Every rank holds the same number of sequences, so each router has as many gates and
    tokens on every rank: a mean over tokens pools as the mean over ranks, a count as the
    sum, and the spread through the second moment (std^2 + mean^2). Collective: every rank
    calls it, with summaries of the same layout; one all-reduce for all of them.
    """
    return _unpooled(summaries, mean_over_ranks(_pooling_values(summaries)), world_size)


def pool_as_ranks(shares: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """One micro-batch's statistics from those of its row blocks, each one process's share computed
    here in turn (mode.evaluate of a multi-process run): pooled as pool_summaries pools ranks."""
    if len(shares) == 1 or not shares[0]:
        return shares[0]
    columns = zip(*(_pooling_values([share]) for share in shares), strict=True)
    return _unpooled([shares[0]], [sum(column) / len(shares) for column in columns], len(shares))[0]


def _pooling_values(summaries: list[dict[str, dict[str, Any]]]) -> list[float]:
    """The statistics as the values that average over ranks: gate_std as the second moment."""
    flat: list[float] = []
    for summary in summaries:
        for stats in summary.values():
            for name, value in stats.items():
                if name == "gate_std":
                    value = value**2 + stats["gate_mean"] ** 2
                flat.extend(value if isinstance(value, list) else [value])
    return flat


def _unpooled(summaries: list[dict[str, dict[str, Any]]], pooled_values: list[float], world_size: int
              ) -> list[dict[str, dict[str, Any]]]:
    """The layout of summaries filled with pooled_values (their _pooling_values averaged over ranks)."""
    pooled = iter(pooled_values)
    out = []
    for summary in summaries:
        out.append({})
        for layer, stats in summary.items():
            new = out[-1][layer] = {}
            for name, value in stats.items():
                n = len(value) if isinstance(value, list) else 1
                vals = [next(pooled) * (world_size if name in COUNT_STATS else 1) for _ in range(n)]
                new[name] = [round(v, 5) for v in vals] if isinstance(value, list) else vals[0]
            new["gate_std"] = math.sqrt(max(0.0, new["gate_std"] - new["gate_mean"] ** 2))
    return out


def processed_fraction(routing: DepthRouting | ExpertChoiceRouting) -> Tensor:
    """Share of tokens a routing by positions in a group sent through (depth or expert choice); 0-d."""
    groups, tokens_per_group = routing.logits.shape[:2]
    return token_mask(routing.positions.reshape(groups, -1), tokens_per_group).float().mean()


def output_tensors(out: ModelOutput, loss_keys: Sequence[str]) -> tuple[list[Tensor], dict[str, dict[str, Tensor]]]:
    """The named losses and every routed layer's summary_tensors, still on the device."""
    return [getattr(out, key).detach() for key in loss_keys], {layer: summary_tensors(r) for layer, r in routed_layers(out)}


def copy_outputs(tensors: tuple[list[Tensor], dict[str, dict[str, Tensor]]]) -> tuple[list[Tensor], dict[str, dict[str, Tensor]]]:
    """output_tensors' result with every tensor cloned (detached)."""
    losses, summaries = tensors
    return ([t.detach().clone() for t in losses],
            {layer: {name: t.detach().clone() for name, t in stats.items()} for layer, stats in summaries.items()})


Outputs = list[tuple[list[Tensor], dict[str, dict[str, Tensor]]]]  # output_tensors of each micro-batch


def expert_loads(outputs: Outputs) -> list[Tensor]:
    """Every bias-balanced expert router's load (E,) of a step, its micro-batches summed, on the device,
    in layer order (the order of the model's routers): what TokenChoiceRouter.update_bias takes."""
    layers = [layer for layer, stats in outputs[0][1].items() if "expert_load" in stats]
    return [sum(stats[layer]["expert_load"] for _, stats in outputs) for layer in layers]


def outputs_to_host(outputs: Outputs, extra: Sequence[Tensor] = ()) -> HostCopy:
    """output_tensors of several micro-batches (and extra 0-d tensors), queued to the host in one transfer."""
    flat = [t for losses, stats in outputs for t in [*losses, *(v for per_layer in stats.values() for v in per_layer.values())]]
    return HostCopy(flat + list(extra))


def parse_outputs(outputs: Outputs, loss_keys: Sequence[str], copy: HostCopy,
                  ) -> tuple[list[dict[str, float]], list[dict[str, dict[str, Any]]], list[float]]:
    """outputs_to_host's values: per micro-batch its losses and its layers' summaries, then the extra values."""
    values = iter(copy.values())
    losses, summaries = [], []
    for _, stats in outputs:
        losses.append({key: next(values)[0] for key in loss_keys})
        count = sum(len(per_layer) for per_layer in stats.values())
        summaries.append(summaries_from(stats, [next(values) for _ in range(count)]))
    return losses, summaries, [v[0] for v in values]


def read_output(out: ModelOutput, loss_keys: Sequence[str]) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """The named losses and every routed layer's summary, copied from the device in one transfer."""
    outputs = [output_tensors(out, loss_keys)]
    losses, summaries, _ = parse_outputs(outputs, loss_keys, outputs_to_host(outputs))
    return losses[0], summaries[0]


EXPERT_ROUTER = ".ffn"  # the suffix routed_layers gives an expert router's name


def routed_layers(output: ModelOutput) -> Iterator[tuple[str, Routing]]:
    """(name, routing) of every router: 'layer3' routes around a block, 'layer3.ffn' among experts."""
    for i, (depth, ffn) in enumerate(zip(output.routings, output.ffn_routings)):
        if depth is not None:
            yield f"layer{i}", depth
        if ffn is not None:
            yield f"layer{i}{EXPERT_ROUTER}", ffn


def is_expert_router(name: str) -> bool:
    """Whether a routed_layers name is an expert router's (else a depth router's)."""
    return name.endswith(EXPERT_ROUTER)


def share_reaching(name: str, processed: dict[str, float]) -> float:
    """The share of all tokens that reach router `name`, from the routers' `processed` shares: a
    Staged MoDE FFN (layer3.ffn under layer3) sees only the tokens its depth router chose, and
    reports its own shares over those; every other router sees every token (1.0)."""
    return processed.get(name.removesuffix(EXPERT_ROUTER), 1.0) if is_expert_router(name) else 1.0


def chosen_positions(output: ModelOutput, seq_len: int) -> Iterator[tuple[str, Tensor]]:
    """(name, the sequence positions (N,) in [0, seq_len) its routing chose) for every router whose
    positions are tokens: depth routers, and expert choice's top-C (token choice chooses slots: left out).

    An expert-choice position is a token's place in its group of group_size sequences laid end to end;
    inside a Staged MoDE block the group is of the depth router's chosen tokens, whose index in the
    flattened (B, k) chosen set maps back to a position through the depth router's own positions."""
    for i, (depth, ffn) in enumerate(zip(output.routings, output.ffn_routings)):
        if depth is not None:
            yield f"layer{i}", depth.positions.reshape(-1) % seq_len  # (B, k) positions in their sequences
        if not isinstance(ffn, ExpertChoiceRouting):
            continue
        groups, group_tokens = ffn.logits.shape[:2]
        offsets = torch.arange(groups, device=ffn.positions.device).unsqueeze(1) * group_tokens  # (G, 1)
        flat = (ffn.positions.reshape(groups, -1) + offsets).reshape(-1)  # index among all B * T_inner tokens
        yield f"layer{i}{EXPERT_ROUTER}", (flat % seq_len if depth is None else depth.positions.reshape(-1)[flat])


def position_bins(seq_len: int) -> int:
    """POSITION_BINS, or one bin a position in sequences shorter than that."""
    return min(POSITION_BINS, seq_len)


def position_histogram(positions: Tensor, seq_len: int, bins: int) -> Tensor:
    """How often each of `bins` buckets of the sequence was chosen: positions (N,) -> (bins,).
    Bucket b holds the positions p with p * bins // seq_len == b (bucket_widths)."""
    return torch.bincount(positions * bins // seq_len, minlength=bins).float().cpu()


def bucket_widths(seq_len: int, bins: int) -> Tensor:
    """How many positions each bucket of position_histogram holds: equal where bins divides seq_len."""
    return position_histogram(torch.arange(seq_len), seq_len, bins)


def position_share(histogram: Tensor, seq_len: int) -> list[float]:
    """Each bucket's share of the choices per position it holds, normalised to sum to 1: a router
    choosing every position equally often reads 1 / bins in every bucket, whatever their widths."""
    density = histogram / bucket_widths(seq_len, len(histogram))
    return [round(float(v), 4) for v in density / density.sum()]


def average_summaries(summaries: list[dict[str, dict[str, Any]]], sum_counts: bool = False) -> dict[str, dict[str, Any]]:
    """Per-layer statistics over several micro-batches: means averaged; counts (COUNT_STATS) summed
    with sum_counts (the micro-batches of one optimizer step: its tokens, as over processes), else
    averaged (per validation batch)."""
    out: dict[str, dict[str, Any]] = {}
    for layer in summaries[0]:
        out[layer] = {}
        for key, first in summaries[0][layer].items():
            values = [s[layer][key] for s in summaries]
            divisor = 1 if sum_counts and key in COUNT_STATS else len(values)
            if isinstance(first, list):
                out[layer][key] = [round(sum(col) / divisor, 5) for col in zip(*values)]
            else:
                out[layer][key] = round(sum(values) / divisor, 5)
        if "gate_std" in out[layer]:
            # Every micro-batch has as many gates: the spread of all of them pools, as over
            # processes (pool_summaries), not as a mean of the spreads. Each micro-batch's variance
            # plus its mean's distance from the unrounded overall mean: E[g^2] - mean^2 with the
            # rounded mean lost spreads below about 3e-3 to the rounding (gates near 0.5).
            means = [s[layer]["gate_mean"] for s in summaries]
            mean = sum(means) / len(means)
            variance = sum(s[layer]["gate_std"] ** 2 + (m - mean) ** 2 for s, m in zip(summaries, means)) / len(means)
            out[layer]["gate_std"] = round(math.sqrt(variance), 5)
    return out
