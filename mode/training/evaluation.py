"""The Trainer's evaluation: the validation loss and router statistics of the same validation batches
at every evaluation, pooled over ranks, and under causal routing the loss of the causal decision."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import Tensor

from mode.training.router_stats import (
    average_summaries,
    chosen_positions,
    pool_as_ranks,
    position_bins,
    position_histogram,
    position_share,
    read_output,
    routed_layers,
    share_reaching,
)

if TYPE_CHECKING:
    from mode.training.trainer import Trainer

# Validation draws ignore train.seed: a seed changes the model, never the sequences it is judged on.
VALIDATION_SEED = 0


def validation_metrics(trainer: Trainer) -> dict[str, Any]:
    """Validation loss and router statistics; leaves the global RNG as it found it.

    The random-routing ablation draws from the global RNG, which checkpoints save: were
    evaluation to advance it, a run that evaluates at other steps (a resumed one, whose
    first leg ended with an evaluation) would route differently from then on.
    """
    devices = [trainer.device] if trainer.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        return _evaluate(trainer)


@torch.no_grad()
def _evaluate(trainer: Trainer) -> dict[str, Any]:
    t = trainer.config.train
    trainer.model.eval()
    total, summaries, histograms = 0.0, [], {}
    seq_len = trainer.config.data.seq_len
    bins = position_bins(seq_len)
    for i in range(t.eval_batches):
        shares = []
        for x, y in validation_blocks(trainer, i):
            trainer.mark_step_begin()
            with trainer.autocast():
                out = trainer.forward(x, y)
            micro_losses, summary = read_output(out, ("lm_loss",))
            total += micro_losses["lm_loss"] / trainer.eval_splits
            shares.append(summary)
            for name, positions in chosen_positions(out, seq_len):
                histograms[name] = histograms.get(name, 0) + position_histogram(positions, seq_len, bins)
        summaries.append(pool_as_ranks(shares))
    routing = average_summaries(trainer.pool_over_ranks(summaries)) if summaries[0] else {}
    for name, hist in histograms.items():
        hist = torch.tensor(trainer.mean_of_lists([hist.tolist()])[0])  # every rank's positions
        routing[name]["position_share"] = position_share(hist, seq_len)
    losses = {"val_loss": total / t.eval_batches}
    if trainer.config.routing.causal != "none":
        losses["val_loss_causal"] = _causal_val_loss(trainer, routing)
    return {**trainer.mean_over_ranks(losses), "routing": routing}


def validation_blocks(trainer: Trainer, batch: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Validation batch `batch`, in trainer.eval_splits row blocks of equal size: the same at every
    evaluation and for every train.seed (VALIDATION_SEED), so that runs of a sweep over seeds or
    variants are compared on the same sequences."""
    x, y = trainer.micro_batch(trainer.data.val, -1, batch, seed=VALIDATION_SEED)
    return zip(x.chunk(trainer.eval_splits), y.chunk(trainer.eval_splits), strict=True)


def _causal_val_loss(trainer: Trainer, routing: dict[str, dict[str, Any]]) -> float:
    """The same validation batches routed by the causal decision (as sampling routes them).

    Adds each routed layer's share of tokens actually processed under causal routing
    ("causal_processed"), pooled over the batches: a Staged MoDE FFN's share is of the tokens
    its depth router chose, whose number varies from batch to batch, so each batch weighs by
    it. Runs the uncompiled model: causal routing has data-dependent shapes.
    """
    t = trainer.config.train
    total, processed, weights = 0.0, {}, {}
    for i in range(t.eval_batches):
        for x, y in validation_blocks(trainer, i):
            with trainer.autocast():
                out = trainer.model(x, y, routing_mode="causal")
            total += float(out.lm_loss) / trainer.eval_splits
            shares = {name: float(r.stats["processed"]) for name, r in routed_layers(out) if "processed" in r.stats}
            for name, share in shares.items():
                weight = share_reaching(name, shares)
                processed[name] = processed.get(name, 0.0) + share * weight
                weights[name] = weights.get(name, 0.0) + weight
    names = [name for name in processed if name in routing]
    pooled = trainer.mean_of_lists([[processed[n] for n in names], [weights[n] for n in names]])
    for name, value, weight in zip(names, *pooled):
        routing[name]["causal_processed"] = round(value / weight, 5) if weight > 0 else 0.0
    return total / t.eval_batches
