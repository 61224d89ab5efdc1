"""train.trainable: which parameters a run trains (router tuning trains the routers alone)."""
from __future__ import annotations

import fnmatch

from torch import nn

from mode.config import ConfigError
from mode.routing import CausalPredictor, Router

ALL, ROUTERS = "all", "routers"


def router_parameter_names(model: nn.Module) -> set[str]:
    """Every router's and causal predictor's parameters (depth and expert routers alike)."""
    return {
        f"{name}.{p_name}" if name else p_name
        for name, module in model.named_modules() if isinstance(module, (Router, CausalPredictor))
        for p_name, _ in module.named_parameters()
    }


def trainable_names(model: nn.Module, selectors: list[str]) -> set[str]:
    """The parameter names the selectors name: all, routers, or fnmatch patterns over names.
    A selector that names no parameter is a ConfigError naming train.trainable."""
    names = [name for name, _ in model.named_parameters()]
    chosen: set[str] = set()
    for selector in selectors:
        if selector == ALL:
            found = set(names)
        elif selector == ROUTERS:
            found = router_parameter_names(model)
        else:
            found = set(fnmatch.filter(names, selector))
        if not found:
            what = "this model has no router" if selector == ROUTERS else "it matches no parameter name"
            raise ConfigError(f"train.trainable: {selector!r} selects nothing ({what}; names look like {names[0]!r})")
        chosen |= found
    return chosen


def apply_trainable(model: nn.Module, selectors: list[str]) -> None:
    """Freeze (requires_grad False) every parameter the selectors leave out: no gradient, no
    optimizer state, no weight decay, so it stays bit-identical through training."""
    if selectors == [ALL]:
        return
    keep = trainable_names(model, selectors)
    for name, p in model.named_parameters():
        p.requires_grad_(name in keep)
