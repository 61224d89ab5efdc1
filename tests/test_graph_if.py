"""CUDA graph conditional (IF) nodes (mode/kernels/graph_if.py): natively or through the built
extension, a captured body runs at replay exactly when its predicate is True then."""
from __future__ import annotations

import pytest
import torch

from mode.kernels import graph_if
from mode.layers.chunks import if_nodes_available

needs_if_nodes = pytest.mark.skipif(
    not torch.cuda.is_available() or not graph_if.available(), reason="CUDA graph conditional nodes need a GPU",
)


def test_without_a_gpu_there_are_no_if_nodes_and_nothing_is_built() -> None:
    if torch.cuda.is_available():
        pytest.skip("the CPU answer")
    assert not graph_if.buildable() and not graph_if.available() and not if_nodes_available()
    assert graph_if.extension.cache_info().currsize == 0  # no compiler was started


@needs_if_nodes
def test_an_if_body_runs_at_replay_only_where_its_predicate_holds() -> None:
    x = torch.arange(4.0, device="cuda")
    flag = torch.zeros((), dtype=torch.bool, device="cuda")
    count = torch.zeros((), dtype=torch.long, device="cuda")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: the body's kernels once, outside the capture
        x.copy_(x * 2 + 1)
    torch.cuda.current_stream().wait_stream(side)
    x.copy_(torch.arange(4.0, device="cuda"))
    with torch.cuda.graph(graph):
        with graph_if.captured_if(graph, flag & (count < 10)):
            doubled = x * 2 + 1  # allocated inside the body
            x.copy_(doubled)
        count.add_(1)  # after the node: runs on every replay
    torch.cuda.synchronize()
    expected = torch.arange(4.0, device="cuda")
    for taken in (False, True, True, False, True):
        flag.fill_(taken)
        graph.replay()
        expected = expected * 2 + 1 if taken else expected
    torch.cuda.synchronize()
    assert torch.equal(x, expected) and int(count) == 5


@needs_if_nodes
def test_nested_if_nodes_each_keep_their_own_predicate() -> None:
    x = torch.zeros(3, device="cuda")
    outer = torch.zeros((), dtype=torch.bool, device="cuda")
    inner = torch.zeros((), dtype=torch.bool, device="cuda")
    graph = torch.cuda.CUDAGraph()
    x.add_(1)
    x.add_(10)
    torch.cuda.synchronize()
    x.zero_()
    with torch.cuda.graph(graph):
        with graph_if.captured_if(graph, outer.clone()):
            x.add_(1)
            with graph_if.captured_if(graph, inner.clone()):
                x.add_(10)
    for o, i, added in ((False, True, 0), (True, False, 1), (True, True, 11), (False, False, 0)):
        outer.fill_(o)
        inner.fill_(i)
        before = x.clone()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(x - before, torch.full_like(x, float(added))), (o, i)


@needs_if_nodes
@pytest.mark.parametrize("rows", [1, 5, 1500], ids=["one row", "a few rows", "more rows than threads"])
def test_a_counted_if_runs_where_its_flags_count_lies_in_its_bounds(rows: int) -> None:
    flags = torch.zeros(rows, dtype=torch.bool, device="cuda")
    runs = torch.zeros(2, dtype=torch.long, device="cuda")  # (lo 0 < count <= 1, 1 < count <= rows)
    graph = torch.cuda.CUDAGraph()
    runs.add_(0)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        with graph_if.captured_if_count(graph, flags, 0, 1):
            runs[0].add_(1)
        with graph_if.captured_if_count(graph, flags, 1, rows):
            runs[1].add_(1)
    expected = torch.zeros(2, dtype=torch.long)
    for count in sorted({c for c in (0, 1, 2, rows // 2, rows) if c <= rows}):
        flags.zero_()
        flags[torch.randperm(rows, device="cuda")[:count]] = True
        graph.replay()
        expected += torch.tensor([0 < count <= 1, 1 < count <= rows])
        torch.cuda.synchronize()
        assert torch.equal(runs.cpu(), expected), count


def test_every_exported_function_is_declared_and_defined_once() -> None:
    """The extension builds only where a GPU and nvcc are: its bindings' names are checked here
    against the declarations and the source on any machine."""
    import re

    for name in graph_if._FUNCTIONS:
        pattern = rf"^void {name}\("
        assert len(re.findall(pattern, graph_if._DECLARATIONS, re.M)) == 1, name
        assert len(re.findall(pattern, graph_if._SOURCE, re.M)) == 1, name
    assert len(re.findall(r"^void \w+\(", graph_if._DECLARATIONS, re.M)) == len(graph_if._FUNCTIONS)


def test_a_decision_left_to_an_if_node_needs_that_node() -> None:
    """StaticStep._run_if refuses a decision its IF node would not take (no capture, no node, or
    other flags) where the host did not count: the flags would be read unwritten."""
    from types import SimpleNamespace

    from mode.layers.chunks import StaticStep

    flags = torch.zeros(2, dtype=torch.bool)
    decision = graph_if.RowDecision(torch.zeros(2, 4), torch.zeros(4), None, None, flags, torch.zeros(2))
    for graph, test, given in ((None, True, flags), ("graph", False, flags), ("graph", True, flags.clone())):
        with pytest.raises(RuntimeError, match="IF node"):
            StaticStep._run_if(SimpleNamespace(graph=graph), lambda: None, given, 0, 2, test, None, decision)
    if not torch.cuda.is_available():
        assert not graph_if.decides_in_condition()


needs_decided_ifs = pytest.mark.skipif(
    not torch.cuda.is_available() or not graph_if.decides_in_condition(),
    reason="an IF node that takes the decision needs the built extension on a GPU",
)


@needs_decided_ifs
@pytest.mark.parametrize("rows", [1, 5, 40], ids=["one row", "a few rows", "more rows than a pass"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_bias, with_active", [(True, True), (False, False)])
def test_an_if_node_taking_the_decision_writes_the_decision_kernels_flags(rows: int, dtype: torch.dtype,
                                                                          with_bias: bool, with_active: bool) -> None:
    """captured_if_decided: at each replay the condition kernel writes the scores x @ w + b and the
    flags (score > 0, active rows only) as decide_rows computes them (float32 sums in another
    order: 1e-5 of the sum's scale), and the body runs where some row chose; graph_if.decide
    writes the same bits without a node."""
    from mode.kernels.decision import decide_rows

    width = 200  # not a multiple of a warp's columns
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, width, device="cuda", generator=g).to(dtype)
    weight = torch.randn(width, device="cuda", generator=g)
    bias = torch.tensor([0.25], device="cuda") if with_bias else None
    active = torch.rand(rows, device="cuda", generator=g) > 0.2 if with_active else None
    chosen = torch.zeros(rows, dtype=torch.bool, device="cuda")
    scores = torch.zeros(rows, device="cuda")
    runs = torch.zeros((), dtype=torch.long, device="cuda")
    graph = torch.cuda.CUDAGraph()
    runs.add_(1)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        with graph_if.captured_if_decided(graph, graph_if.RowDecision(x, weight, bias, active, chosen, scores),
                                          0, rows):
            runs.add_(1)
    expected_runs = 1
    for draw in range(4):  # the last draw: no row chooses
        x.copy_(torch.randn(rows, width, device="cuda", generator=g) if draw < 3 else -x.abs().sign())
        weight.copy_(weight.abs() if draw == 3 else weight)
        graph.replay()
        torch.cuda.synchronize()
        ref_chosen, ref_scores = decide_rows(x, weight.view(1, -1), bias, active)
        scale = (x.float().abs() @ weight.abs()).max().item()
        torch.testing.assert_close(scores, ref_scores, rtol=0, atol=1e-5 * scale)
        clear = ref_scores.abs() > 1e-4 * scale  # away from the threshold both sums agree
        assert torch.equal(chosen[clear], ref_chosen[clear]), draw
        assert draw < 3 or not chosen.any()
        again = graph_if.RowDecision(x, weight, bias, active, torch.empty_like(chosen), torch.empty_like(scores))
        graph_if.decide(again)  # the same kernel without a node: the same bits
        assert torch.equal(again.chosen, chosen) and torch.equal(again.scores, scores)
        expected_runs += bool(chosen.any())
        assert int(runs) == expected_runs, draw
