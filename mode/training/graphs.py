"""The eager model's micro-batch as one CUDA graph (train.cuda_graphs), and where it cannot run."""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from mode.config import Config, ConfigError
from mode.layers.moe import MoEFFN
from mode.model import ModelOutput


# ----------------------------------------------------------------------------- eager CUDA graphs
def eager_graphs(config: Config, device: torch.device, model: nn.Module,
                 engine_refusal: str | None = None) -> tuple[bool, str | None]:
    """Whether the eager model's micro-batches run as CUDA graphs (train.cuda_graphs), and, where
    auto decides on a GPU, a note for the user saying which and why. true: required, and an error naming
    the field where they cannot run; auto: wherever they can; false: never. Without graphs an eager
    routed model is bound by the host's launches (bench/block_profile.py), with them by its kernels.
    engine_refusal: why a multi-process engine's backward cannot be captured (None: it can, or one
    process, whose backward always can)."""
    t = config.train
    if t.cuda_graphs is False or t.compile:  # compiled: train.compile_mode=reduce-overhead graphs it
        return False, None
    required = t.cuda_graphs is True
    if device.type != "cuda":
        if required:
            raise ConfigError(f"train.cuda_graphs needs a CUDA device (train.device is {t.device!r}: {device})")
        return False, None
    if engine_refusal is not None:
        refuse_required_graphs(config, engine_refusal)
        return False, f"train.cuda_graphs=auto: plain eager, since {engine_refusal}" + _host_bound_hint(config)
    reason = _host_reading_layer(model, device)
    if reason is None:
        return True, None if required else ("train.cuda_graphs=auto: each micro-batch's forward and backward run as one "
                                            "CUDA graph, captured at the first step (false: plain eager)")
    if required:
        raise ConfigError(f"train.cuda_graphs: {reason}; use moe.capacity_factor instead of dropless")
    return False, f"train.cuda_graphs=auto: plain eager, since {reason}"


def refuse_required_graphs(config: Config, engine_refusal: str | None) -> None:
    """train.cuda_graphs=true where a multi-process engine's backward cannot be captured: a
    ConfigError naming the setting that stops it (engine_refusal, from the engine)."""
    if config.train.cuda_graphs is True and engine_refusal is not None:
        raise ConfigError(f"train.cuda_graphs=true: {engine_refusal}; set train.cuda_graphs=auto or false")


def _host_bound_hint(config: Config) -> str:
    """For a multi-process run that cannot graph: a routed layer launches about a dense layer's
    kernels for a fraction of its work, so a routed model's eager step waits on the host
    (docs/gpu.md); torch.compile, which such runs allow, takes the launches off it. Empty for an
    all-dense model."""
    if all(kind == "dense" for kind in config.model.block_kinds()):
        return ""
    return ("; a routed model's plain eager step is paced by the host's kernel launches, "
            "--train.compile=true takes them off the host")


def _host_reading_layer(model: nn.Module, device: torch.device) -> str | None:
    """The first MoE FFN that reads its routing on the host (bf16 tokens on this device, as training
    runs them), which would fail a capture mid-step; None if there is none."""
    probe = torch.empty(1, 8, device=device, dtype=torch.bfloat16)
    for name, module in model.named_modules():
        if isinstance(module, MoEFFN) and module.syncs_with_host(probe):
            backend = module.experts.backend
            if backend != "torch":
                why = f"token choice on moe.backend={backend} sizes its expert groups there"
            elif getattr(module.experts, "ep_size", 1) > 1:  # mode/parallel's experts, sharded over processes
                why = "dropless token choice sends uneven rows between the expert-parallel processes, sized there"
            else:
                why = ("dropless token choice runs sync-free on moe.backend=torch only on an H100/H200-class GPU "
                       f"(this is a {torch.cuda.get_device_name(device)})")
            return f"{name} reads its routing on the host: {why}"
    return None


class GraphedMicroStep:
    """One micro-batch's forward and backward as one CUDA graph, for the eager model (train.cuda_graphs).

    Captured on the first call, after warm-up passes on a side stream (cuBLAS and Triton set
    themselves up; their gradients are dropped before it), then replayed: the batch is copied into
    the graph's input tensors and one launch runs every kernel. Without torch.compile this
    removes the host's cost per kernel, which routed blocks feel most: their many small kernels
    leave an eager block bound by the host's launches.

    The returned outputs live in the graph's memory, which the next replay overwrites: copy
    what must outlive it (the Trainer does). The gradients are the graph's too: the first
    micro-batch's graph writes them (each parameter's gradient is the backward's own tensor, no
    zeroing and no add), and with loss_divisor > 1 a second graph, sharing the first's memory,
    adds the later micro-batches' into them. In one process the optimizer must neither free nor
    zero them (TorchOptimization(keep_grads=True, zero_grads=False)). backward(loss, accumulate)
    is told which of the two it runs in (accumulate: the second); `summed` are parameters whose
    gradient the backward itself moves elsewhere (bf16 weights' float32 sums), leaving no .grad.

    With a multi-process engine (after_replay given), `backward` is the part of its backward a graph
    can hold (autograd alone) and after_replay the rest, run on the host after each replay (the
    gradients' all-reduce at the accumulation boundary). Such an engine drops the parameters'
    gradients after its step: each replay hands every parameter the graph's tensor again first.
    """

    WARMUP_PASSES = 3

    def __init__(self, model: nn.Module, backward: Callable[[Tensor, bool], None], loss_divisor: int,
                 after_replay: Callable[[], None] | None = None, summed: Sequence[nn.Parameter] = ()) -> None:
        self.model, self.backward, self.loss_divisor = model, backward, loss_divisor
        self.after_replay = after_replay
        self.summed = {id(p) for p in summed}
        self.grads: list[tuple[nn.Parameter, Tensor]] = []  # each parameter's gradient as the graph writes it
        self.graph: torch.cuda.CUDAGraph | None = None  # the first micro-batch's: writes the gradients
        self.adding_graph: torch.cuda.CUDAGraph | None = None  # the later ones': adds into them

    def forget(self) -> None:
        """Capture again at the next call: the model's shapes changed (a new routed capacity)."""
        self.graph = self.adding_graph = None

    def __call__(self, x: Tensor, y: Tensor, accumulate: bool = False) -> ModelOutput:
        """One micro-batch; accumulate: add its gradients into the step's (a later micro-batch)
        instead of writing them (the step's first)."""
        if self.graph is None:
            if accumulate:
                raise RuntimeError("GraphedMicroStep: a step's first micro-batch must not accumulate")
            self._capture(x, y)
        if accumulate and self.adding_graph is None:
            raise RuntimeError("GraphedMicroStep: accumulate=True needs loss_divisor > 1")
        self.x.copy_(x)
        self.y.copy_(y)
        (self.adding_graph if accumulate else self.graph).replay()
        if self.after_replay is not None:
            for p, grad in self.grads:  # an engine's step set them to None
                p.grad = grad
            self.after_replay()
        return self.adding_out if accumulate else self.out

    def _pass(self, accumulate: bool = False) -> ModelOutput:
        # No autocast cache: cast weights cached across the capture's boundary would outlive it.
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            out = self.model(self.x, self.y)
        self.backward(out.loss / self.loss_divisor, accumulate)
        return out

    def _capture(self, x: Tensor, y: Tensor) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad and id(p) not in self.summed]
        self.x, self.y = x.clone(), y.clone()  # the graph's inputs: each call copies its batch in
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        # The warm-up passes draw no numbers from the run's generators (routing.random): replay k
        # draws what eager pass k would, and a resumed run, which captures again, what the
        # uninterrupted one drew.
        with torch.cuda.stream(side), torch.random.fork_rng(devices=[self.x.device]):
            for _ in range(self.WARMUP_PASSES):
                self._pass()
        torch.cuda.current_stream().wait_stream(side)
        for p in params:  # no gradient yet: the captured backward hands each parameter its own tensor
            p.grad = None
        # With an engine, other threads (the process group's watchdog) may touch CUDA meanwhile:
        # only this thread's calls must be capturable.
        mode = "global" if self.after_replay is None else "thread_local"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode=mode):
            self.out = self._pass()
        for p in params:  # a parameter no micro-batch reaches keeps a zero gradient, as eager steps see it
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.grads = [(p, p.grad) for p in params]
        if self.loss_divisor > 1:  # captured now: its capture runs nothing, so no gradient moves
            adding = torch.cuda.CUDAGraph()
            with torch.cuda.graph(adding, pool=graph.pool(), capture_error_mode=mode):
                self.adding_out = self._pass(accumulate=True)
            self.adding_graph = adding
        self.graph = graph
