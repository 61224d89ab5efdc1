"""CUDA graph conditional (IF) nodes for a torch that cannot capture them itself.

A static decode step skips a routed layer that no row chose by capturing the layer's kernels
into an IF node of the step's CUDA graph: at replay, a one-block kernel counts the rows' bool
flags on the device and sets the node's condition (lo < count <= hi), so nothing waits for the
host and the skip costs that one kernel. torch captures such nodes where `torch.cuda.CUDAGraph`
has `begin_capture_to_if_node` (the count then takes a few PyTorch ops); elsewhere this module
builds a small extension (once per machine, with torch's own `load_inline`, about a minute)
that adds them through the CUDA runtime (CUDA 12.4 or newer):

    begin_if(flags, lo, hi)  # the current stream's capture gets an IF node; the stream now captures its body
    ...                      # kernels launched here run at replay only where lo < flags.sum() <= hi then
    end_if()                 # the body ends; the current stream is the capturing one again

A routed layer's IF node can also take the layer's decision (`captured_if_decided`): its
condition kernel computes the rows' router scores and flags first, so a skipped layer costs one
kernel, not a decision kernel and a condition kernel. `decide` runs the same kernel without a
node, for the uncaptured step.

The body's tensors come from a memory pool of their own (`body_pool`), kept with the graph:
the graph's pool serves only its own capture's stream.
"""
from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor

_DECLARATIONS = """
void begin_if(const at::Tensor& flags, int64_t lo, int64_t hi);
void begin_if_decided(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      const std::optional<at::Tensor>& active, const at::Tensor& chosen, const at::Tensor& scores,
                      int64_t lo, int64_t hi);
void decide(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
            const std::optional<at::Tensor>& active, const at::Tensor& chosen, const at::Tensor& scores);
void end_if();
"""

_FUNCTIONS = ("begin_if", "begin_if_decided", "decide", "end_if")  # what the built module exports

_SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <map>
#include <vector>

namespace {

// One block: the number of true flags, then condition = lo < count <= hi.
__global__ void set_condition(cudaGraphConditionalHandle handle, const bool* flags, int64_t n, int64_t lo,
                              int64_t hi) {
  __shared__ int64_t count;
  if (threadIdx.x == 0) count = 0;
  __syncthreads();
  int64_t mine = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) mine += flags[i];
  if (mine) atomicAdd(reinterpret_cast<unsigned long long*>(&count), static_cast<unsigned long long>(mine));
  __syncthreads();
  if (threadIdx.x == 0) cudaGraphSetConditional(handle, (count > lo && count <= hi) ? 1u : 0u);
}

// One block of 1024 threads: a routed layer's decision for rows x (rows, width), chosen =
// x @ weight + bias > 0 and active, with the scores, then (where set) the condition on the chosen
// count. Each pass takes up to 32 rows, 32 / rows warps a row (at one row, every thread one column).
template <typename T>
__global__ void decide_set_condition(cudaGraphConditionalHandle handle, bool set, const T* x, const float* weight,
                                     const float* bias, const bool* active, bool* chosen, float* scores,
                                     int64_t rows, int64_t width, int64_t lo, int64_t hi) {
  __shared__ float partial[32];
  __shared__ int64_t count;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (threadIdx.x == 0) count = 0;
  for (int64_t first = 0; first < rows; first += 32) {
    const int here = rows - first < 32 ? static_cast<int>(rows - first) : 32;
    const int group = 32 / here;  // warps a row
    const int slot = warp / group;  // this warp's row of the pass
    float acc = 0.f;
    if (slot < here) {
      const T* row = x + (first + slot) * width;
      for (int64_t d = (warp % group) * 32 + lane; d < width; d += group * 32) {
        acc += static_cast<float>(row[d]) * weight[d];
      }
    }
    for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_down_sync(0xffffffffu, acc, offset);
    __syncthreads();  // the previous pass has read its partials
    if (lane == 0) partial[warp] = acc;
    __syncthreads();
    if (threadIdx.x < here) {
      float score = 0.f;
      for (int part = 0; part < group; ++part) score += partial[threadIdx.x * group + part];
      if (bias != nullptr) score += *bias;
      const int64_t r = first + threadIdx.x;
      const bool taken = score > 0.f && (active == nullptr || active[r]);
      scores[r] = score;
      chosen[r] = taken;
      if (taken) atomicAdd(reinterpret_cast<unsigned long long*>(&count), 1ull);
    }
  }
  __syncthreads();
  if (set && threadIdx.x == 0) cudaGraphSetConditional(handle, (count > lo && count <= hi) ? 1u : 0u);
}

struct OpenIf {
  c10::cuda::CUDAStream parent;
  c10::cuda::CUDAStream body;
};
std::vector<OpenIf> open_ifs;  // nested IF nodes, innermost last
// Body streams of our own, one per device and nesting depth: a stream from torch's pool may be
// the very stream torch is capturing on (the pool hands its streams out round-robin).
std::map<int, std::vector<cudaStream_t>> body_streams;

void check(cudaError_t error, const char* call) {
  TORCH_CHECK(error == cudaSuccess, call, " failed: ", cudaGetErrorString(error));
}

// The graph the stream is capturing and the nodes its next work depends on.
void capture_info(cudaStream_t stream, cudaGraph_t* graph, const cudaGraphNode_t** deps, size_t* count) {
  cudaStreamCaptureStatus status;
#if CUDART_VERSION >= 13000
  check(cudaStreamGetCaptureInfo(stream, &status, nullptr, graph, deps, nullptr, count), "cudaStreamGetCaptureInfo");
#else
  check(cudaStreamGetCaptureInfo(stream, &status, nullptr, graph, deps, count), "cudaStreamGetCaptureInfo");
#endif
  TORCH_CHECK(status == cudaStreamCaptureStatusActive, "an IF node needs the current stream under CUDA graph capture");
}

c10::cuda::CUDAStream body_stream(c10::DeviceIndex device, size_t depth) {
  auto& streams = body_streams[device];
  while (streams.size() <= depth) {
    cudaStream_t stream;
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    streams.push_back(stream);
  }
  return c10::cuda::getStreamFromExternal(streams[depth], device);
}

// The current stream's capture gets an IF node on a new handle, whose condition condition(handle,
// stream) sets from a kernel it launches; the current stream then captures the node's body.
template <typename SetCondition>
void begin_if_node(SetCondition condition) {
  auto parent = c10::cuda::getCurrentCUDAStream();
  cudaGraph_t graph;
  const cudaGraphNode_t* deps;
  size_t count;
  capture_info(parent.stream(), &graph, &deps, &count);
  cudaGraphConditionalHandle handle;
  check(cudaGraphConditionalHandleCreate(&handle, graph, 0, 0), "cudaGraphConditionalHandleCreate");
  condition(handle, parent.stream());
  check(cudaGetLastError(), "the IF node's condition kernel launch");
  capture_info(parent.stream(), &graph, &deps, &count);  // now ending in the condition kernel

  cudaGraphNodeParams params{};
  params.type = cudaGraphNodeTypeConditional;
  params.conditional.handle = handle;
  params.conditional.type = cudaGraphCondTypeIf;
  params.conditional.size = 1;
  cudaGraphNode_t node;
#if CUDART_VERSION >= 13000
  check(cudaGraphAddNode(&node, graph, deps, nullptr, count, &params), "cudaGraphAddNode");
  check(cudaStreamUpdateCaptureDependencies(parent.stream(), &node, nullptr, 1, cudaStreamSetCaptureDependencies),
        "cudaStreamUpdateCaptureDependencies");
#else
  check(cudaGraphAddNode(&node, graph, deps, count, &params), "cudaGraphAddNode");
  check(cudaStreamUpdateCaptureDependencies(parent.stream(), &node, 1, cudaStreamSetCaptureDependencies),
        "cudaStreamUpdateCaptureDependencies");
#endif
  auto body = body_stream(parent.device_index(), open_ifs.size());
  check(cudaStreamBeginCaptureToGraph(body.stream(), params.conditional.phGraph_out[0], nullptr, nullptr, 0,
                                      cudaStreamCaptureModeRelaxed),
        "cudaStreamBeginCaptureToGraph");
  c10::cuda::setCurrentCUDAStream(body);
  open_ifs.push_back({parent, body});
}

void check_vector(const at::Tensor& t, at::ScalarType dtype, int64_t n, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.is_contiguous() && t.scalar_type() == dtype && t.numel() == n, "the decision's ",
              name, " must be a contiguous CUDA tensor of ", n, " ", c10::toString(dtype), " elements");
}

// decide_set_condition on stream, its arguments checked; set: the handle's condition too.
void launch_decision(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& active, const at::Tensor& chosen, const at::Tensor& scores,
                     cudaGraphConditionalHandle handle, bool set, int64_t lo, int64_t hi, cudaStream_t stream) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.dim() == 2 && x.size(0) >= 1,
              "the decision's x must be contiguous (rows, width) on CUDA");
  const int64_t rows = x.size(0), width = x.size(1);
  check_vector(weight, at::kFloat, width, "weight");
  if (bias) check_vector(*bias, at::kFloat, 1, "bias");
  if (active) check_vector(*active, at::kBool, rows, "active");
  check_vector(chosen, at::kBool, rows, "chosen");
  check_vector(scores, at::kFloat, rows, "scores");
  const float* bias_ptr = bias ? bias->data_ptr<float>() : nullptr;
  const bool* active_ptr = active ? active->data_ptr<bool>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "decide_set_condition", [&] {
    decide_set_condition<scalar_t><<<1, 1024, 0, stream>>>(
        handle, set, x.data_ptr<scalar_t>(), weight.data_ptr<float>(), bias_ptr, active_ptr, chosen.data_ptr<bool>(),
        scores.data_ptr<float>(), rows, width, lo, hi);
  });
}

}  // namespace

void begin_if(const at::Tensor& flags, int64_t lo, int64_t hi) {
  TORCH_CHECK(flags.is_cuda() && flags.is_contiguous() && flags.numel() >= 1 && flags.scalar_type() == at::kBool,
              "the IF node's flags must be a contiguous bool CUDA tensor");
  const int64_t n = flags.numel();
  const int threads = static_cast<int>(std::min<int64_t>(1024, (n + 31) / 32 * 32));
  begin_if_node([&](cudaGraphConditionalHandle handle, cudaStream_t stream) {
    set_condition<<<1, threads, 0, stream>>>(handle, flags.data_ptr<bool>(), n, lo, hi);
  });
}

void begin_if_decided(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      const std::optional<at::Tensor>& active, const at::Tensor& chosen, const at::Tensor& scores,
                      int64_t lo, int64_t hi) {
  begin_if_node([&](cudaGraphConditionalHandle handle, cudaStream_t stream) {
    launch_decision(x, weight, bias, active, chosen, scores, handle, true, lo, hi, stream);
  });
}

void decide(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
            const std::optional<at::Tensor>& active, const at::Tensor& chosen, const at::Tensor& scores) {
  launch_decision(x, weight, bias, active, chosen, scores, 0, false, 0, 0, c10::cuda::getCurrentCUDAStream().stream());
  check(cudaGetLastError(), "the decision kernel launch");
}

void end_if() {
  TORCH_CHECK(!open_ifs.empty(), "end_if without a begin_if");
  OpenIf open = open_ifs.back();
  open_ifs.pop_back();
  cudaGraph_t body_graph;
  c10::cuda::setCurrentCUDAStream(open.parent);
  check(cudaStreamEndCapture(open.body.stream(), &body_graph), "cudaStreamEndCapture");
}
"""


def native() -> bool:
    """Whether this torch captures IF nodes itself."""
    return hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node")


def buildable() -> bool:
    """Whether the extension can be built here: a CUDA GPU, CUDA 12.4 or newer, and its compiler."""
    from torch.utils.cpp_extension import CUDA_HOME

    version = torch.version.cuda
    if not torch.cuda.is_available() or version is None or CUDA_HOME is None:
        return False
    major, minor = (int(part) for part in version.split(".")[:2])
    return (major, minor) >= (12, 4)


@functools.cache
def extension() -> ModuleType:
    """The built extension (compiled on first use, then loaded from torch's extension cache)."""
    from torch.utils.cpp_extension import load_inline

    print("mode: building the CUDA graph IF-node extension (once per machine)", file=sys.stderr)
    return load_inline(name="mode_graph_if", cpp_sources=_DECLARATIONS, cuda_sources=_SOURCE,
                       functions=list(_FUNCTIONS), verbose=False)


@functools.cache
def available() -> bool:
    """Whether IF nodes can be captured here: natively, or through the extension once it builds
    (a failed build is reported once and leaves them off)."""
    if native():
        return True
    if not buildable():
        return False
    try:
        extension()
    except Exception as e:  # a compiler or CUDA runtime that cannot build it: the callers fall back
        print(f"mode: CUDA graph IF nodes unavailable, the extension did not build: {e}", file=sys.stderr)
        return False
    return True


def body_pool(graph: torch.cuda.CUDAGraph) -> torch.cuda.MemPool:
    """The memory pool of the graph's IF bodies, kept on the graph so that it lives as long."""
    pool = getattr(graph, "_mode_if_pool", None)
    if pool is None:
        pool = torch.cuda.MemPool()
        graph._mode_if_pool = pool
    return pool


def captured_if(graph: torch.cuda.CUDAGraph, predicate: Tensor) -> contextlib.AbstractContextManager:
    """The kernels launched inside run at replay only where the one-element bool predicate is True
    then (an IF node of the graph being captured). Their outputs must go into tensors made before it."""
    return captured_if_count(graph, predicate, 0, 1)


@dataclass
class RowDecision:
    """A routed layer's decision that its IF node's condition kernel takes (captured_if_decided):
    for rows x (n, D), chosen = (x @ weight + bias > 0) & active, written with the scores into
    chosen (n,) bool and scores (n,) float32. weight (D,) and bias (1,) float32; bias and active
    (n,) bool may be None."""

    x: Tensor
    weight: Tensor
    bias: Tensor | None
    active: Tensor | None
    chosen: Tensor
    scores: Tensor

    def tensors(self) -> tuple[Tensor | None, ...]:
        """The fields in the extension's argument order (x, weight, bias, active, chosen, scores)."""
        return self.x, self.weight, self.bias, self.active, self.chosen, self.scores


def decides_in_condition() -> bool:
    """Whether an IF node's condition kernel can take a routed layer's decision here: the built
    extension's (torch's own nodes count flags that PyTorch ops made)."""
    return not native() and available()


def captured_if_count(graph: torch.cuda.CUDAGraph, flags: Tensor, lo: int, hi: int) -> contextlib.AbstractContextManager:
    """The kernels launched inside run at replay only where lo < flags.sum() <= hi then, flags: a
    bool tensor (an IF node of the graph being captured). Their outputs must go into tensors made
    before it."""
    flags = flags.reshape(-1).contiguous()
    if native():
        if (flags.numel(), lo, hi) == (1, 0, 1):
            predicate = flags.view(())
        else:
            count = flags.sum()
            predicate = (count > lo) & (count <= hi)  # held until the capture ends, as flags is
        return _native_if(graph, predicate)
    return _built_if(graph, lambda built: built.begin_if(flags, lo, hi))


def decide(decision: RowDecision) -> None:
    """decision's flags and scores written now, on the current stream, by captured_if_decided's
    kernel without its node: where a step runs uncaptured, the same arithmetic as captured."""
    built = _deciding_extension("graph_if.decide")
    with torch.cuda.device(decision.x.device):  # the extension launches on the current device's stream
        built.decide(*decision.tensors())


def captured_if_decided(graph: torch.cuda.CUDAGraph, decision: RowDecision, lo: int,
                        hi: int) -> contextlib.AbstractContextManager:
    """captured_if_count over decision.chosen, which the node's condition kernel computes first,
    with the scores (one kernel). Needs the built extension (decides_in_condition)."""
    _deciding_extension("captured_if_decided")
    return _built_if(graph, lambda built: built.begin_if_decided(*decision.tensors(), lo, hi))


def _deciding_extension(caller: str) -> ModuleType:
    """The built extension, for a caller that has it take a routed layer's decision."""
    if not decides_in_condition():
        raise RuntimeError(f"{caller} needs the built IF-node extension (graph_if.decides_in_condition)")
    return extension()


@contextlib.contextmanager
def _native_if(graph: torch.cuda.CUDAGraph, predicate: Tensor) -> Iterator[None]:
    graph.begin_capture_to_if_node(predicate)
    try:
        yield
    finally:
        graph.end_capture_to_conditional_node()


@contextlib.contextmanager
def _built_if(graph: torch.cuda.CUDAGraph, begin: Callable[[ModuleType], None]) -> Iterator[None]:
    """An IF node through the extension, begun by begin(extension)."""
    built = extension()
    outermost = not getattr(graph, "_mode_if_depth", 0)
    begin(built)
    graph._mode_if_depth = getattr(graph, "_mode_if_depth", 0) + 1
    try:  # nested bodies allocate from the outermost one's pool: a thread routes to one pool at a time
        with torch.cuda.use_mem_pool(body_pool(graph)) if outermost else contextlib.nullcontext():
            yield
    finally:
        graph._mode_if_depth -= 1
        built.end_if()
