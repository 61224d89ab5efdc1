"""Checkpoints: reading checkpoint.pt safely, the rules a resume follows, the RNG state, and the
model a run trains (fresh, or from train.init_from)."""
from __future__ import annotations

import pickle
import sys
import zipfile
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

from mode.config import Config, ConfigError, config_from_dict, field_differences
from mode.convert import conversion_source, converted_state
from mode.layers.experts import check_backend
from mode.model import LanguageModel
from mode.run_folder import CHECKPOINT
from mode.trainable import apply_trainable

# How a run executes, not what it learns: how often it logs, evaluates and saves, where and how
# it runs (and parallel.*: the same mathematics up to rounding).
EXECUTION_FIELDS = (
    "train.log_interval", "train.eval_interval", "train.eval_batches", "train.checkpoint_interval", "train.device",
    "train.compile", "train.compile_mode", "train.cuda_graphs", "train.attention_backend", "train.tensorboard",
    "train.bf16_weights", "train.overlap_update",
)
RESUMABLE_FIELDS = (
    "train.max_steps", "train.flops_budget", "train.progress", "train.out_dir", *EXECUTION_FIELDS,
    "train.init_from",  # a resumed run loads its own weights
)


# ----------------------------------------------------------------------------- checkpoints & plots
def build_model(
    config: Config, device: torch.device | str, resume: bool = False, notes: list[str] | None = None,
) -> LanguageModel:
    """The model a run trains: initialised from train.seed's RNG as it stands, or, for a new run
    with train.init_from, holding that checkpoint's weights (one-device layout: a one-process
    run's, or a multi-process run's with every expert gathered). A resumed run loads its own.
    notes: gets what a conversion (mode/convert.py) computes at step 0, for the user."""
    model = LanguageModel(config).to(device)
    if config.train.init_from is not None and not resume:
        said = load_init_weights(model, config)
        if notes is not None:
            notes.extend(said)
    apply_trainable(model, config.train.trainable)
    return model


def load_init_weights(model: LanguageModel, config: Config) -> list[str]:
    """train.init_from: copy a checkpoint's weights into model; its model section must be this run's,
    except for which layers are routed (model.block_pattern): then the checkpoint's dense / MoE
    layers are converted (mode/convert.py). Returns the conversion's notes (none without one)."""
    path = config.train.init_from
    try:
        payload = load_checkpoint_file(Path(path))
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"train.init_from: {e}") from None
    state, notes = payload["model"], []
    source = conversion_source(payload["config"], config, str(path))
    converting = source is not None
    if converting:
        try:
            state, notes = converted_state(state, source, model.state_dict(), config)
        except ConfigError as e:
            raise ConfigError(f"train.init_from: converting {path}: {e}") from None
    differ = field_differences(payload["config"], config, lambda name: name.startswith("model.") and not converting)
    if differ:
        raise ConfigError(f"train.init_from: {path} holds another model: {', '.join(differ)}")
    try:
        model.load_state_dict(state)
    except RuntimeError as e:  # routing or moe fields that add, drop or reshape weights
        routed = field_differences(payload["config"], config, lambda name: name.startswith(("routing.", "moe.")))
        first = str(e).strip().splitlines()[-1].strip()
        raise ConfigError(
            f"train.init_from: the weights in {path} do not fit this model ({first}); its routing / moe "
            f"fields that differ: {', '.join(routed) or 'none'}"
        ) from None
    return notes


def describes_execution(name: str) -> bool:
    """Whether a config field says how a run executes (EXECUTION_FIELDS, parallel.*), not what it learns."""
    return name in EXECUTION_FIELDS or name.startswith("parallel.")


def may_change_on_resume(name: str) -> bool:
    """Fields a resumed run may change: how long it runs, how often it logs, evaluates and saves,
    where and how it executes; every other field defines the curve it continues."""
    return name in RESUMABLE_FIELDS or describes_execution(name)


def curve_differences(saved: dict[str, Any], config: Config) -> list[str]:
    """The fields in which config differs from a run's saved config and that define the curve a resume
    continues (every one but those may_change_on_resume), each as field_differences words them."""
    return field_differences(saved, config, lambda name: not may_change_on_resume(name))


def restore_rng(payload: dict[str, Any], device: torch.device | None = None) -> None:
    """The random generators as a checkpoint saved them: the CPU's, and the CUDA ones of the GPUs here;
    a CUDA `device` (the one this process computes on) takes the generator of the GPU the run computed on."""
    torch.set_rng_state(payload["rng"].cpu())  # the payload may have been mapped to a GPU
    if payload.get("cuda_rng") is not None and torch.cuda.is_available():
        restore_cuda_rng(payload["cuda_rng"])
    run_state = payload.get("cuda_rng_run")
    if run_state is not None and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(run_state.cpu(), device)


def restore_cuda_rng(states: Sequence[Tensor]) -> None:
    """The CUDA generators' states a checkpoint saved (one per GPU its process saw), on the GPUs this
    process sees: a run saved on a machine with more GPUs resumes on one with fewer; GPUs it did not
    have keep their seeds."""
    for index, state in enumerate(states[: torch.cuda.device_count()]):
        torch.cuda.set_rng_state(state.cpu(), index)


def load_checkpoint_file(path: Path, device: torch.device | str = "cpu", mmap: bool = False) -> dict[str, Any]:
    """Read a checkpoint written by this project; a missing or foreign file is a clear error.
    mmap: tensors are mapped, not read (for a look at its step and config)."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; YAML, text or a file cut short is none
        raise ValueError(f"{path} is not a readable checkpoint: not a checkpoint written by mode.train "
                         "(not the zip archive torch.save writes, or cut short)")
    try:
        # weights_only: tensors, numbers, strings and containers, which is all a checkpoint holds;
        # a file that would run code on loading (a pickle of anything else) is refused.
        payload = torch.load(path, map_location=device, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError:  # torch's text advises weights_only=False, which would run the file's code
        raise ValueError(f"{path} is not a readable checkpoint: not a checkpoint written by mode.train (it holds "
                         "objects other than tensors and plain data; refused, as loading them could run code)") from None
    except Exception as e:  # a zip archive of something else, or a damaged one: torch's first line says which
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path} is not a readable checkpoint: not a checkpoint written by mode.train ({first})") from None
    if not isinstance(payload, dict) or payload.get("format") != "mode-checkpoint-v1":
        raise ValueError(f"{path} is not a mode checkpoint (no 'format: mode-checkpoint-v1' entry)")
    return payload


def load_model(checkpoint: str | Path, device: str | torch.device = "cpu") -> LanguageModel:
    """A LanguageModel from a run folder or checkpoint.pt written by mode.train (errors are clear)."""
    return model_from_payload(load_checkpoint_file(Path(checkpoint), device), str(checkpoint), device)


def model_from_payload(payload: dict[str, Any], source: str, device: str | torch.device) -> LanguageModel:
    """The model a loaded checkpoint holds, with its own config (model.config), in eval mode."""
    if not isinstance(payload.get("config"), dict):
        raise ValueError(f"{source} holds no config: not a checkpoint written by mode.train")
    config = config_from_dict(payload["config"], source)
    if "model" not in payload:
        raise ValueError(f"{source} holds no model weights")
    _backend_that_runs_here(config, source)
    model = LanguageModel(config).to(device)
    try:
        model.load_state_dict(payload["model"])
    except RuntimeError as e:  # missing, unexpected or reshaped weights
        raise ValueError(f"{source}: its weights do not fit the model its config describes ({e})") from None
    model.eval()
    return model


def _backend_that_runs_here(config: Config, source: str) -> None:
    """A model trained on moe.backend grouped_gemm or megablocks (GPU extensions) loaded where that
    backend cannot run: the torch backend computes the same experts from the same weights (the
    backends differ only in how they compute), so it takes over, with a note on stderr."""
    if not config.model.has_experts() or config.moe.backend == "torch":
        return
    try:
        check_backend(config.moe.backend)
    except ConfigError as e:
        print(f"note: {source}: moe.backend={config.moe.backend!r} cannot run here ({e}); its experts run on "
              "moe.backend='torch' (the same weights and results)", file=sys.stderr)
        config.moe.backend = "torch"
