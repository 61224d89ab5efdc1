"""loss_vs_flops.png of a run folder."""
from __future__ import annotations

import io
from pathlib import Path

from mode.run_folder import METRICS, PLOT
from mode.utils import (
    atomic_write_bytes,
    read_metrics,
)


def plot_losses(run_dir: Path) -> Path:
    """loss_vs_flops.png: train and validation loss against cumulative training FLOPs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records, _ = read_metrics(run_dir / METRICS)  # a line cut short by a crash is left out
    train = [(r["flops"], r["loss"]) for r in records if "loss" in r]
    val = [(r["flops"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train), label="train")
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    ax.set_xlabel("cumulative training FLOPs")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(run_dir.name)
    ax.legend()
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    target = run_dir / PLOT
    atomic_write_bytes(target, png.getvalue())
    return target
