"""batchrules.linear's Python entry: the unboxed eager fast path must behave
exactly like the torch.ops call it stands in for."""
from typing import Any, List

import pytest
import torch

import batchrules


def test_fast_path_matches_torch_ops() -> None:
    x, w, b = torch.randn(5, 3, requires_grad=True), torch.randn(4, 3), torch.randn(4)
    fast = batchrules.linear(x, w, b)
    boxed = torch.ops.batchrules.linear.default(x, w, b)
    torch.testing.assert_close(fast, boxed, rtol=0, atol=0)
    assert fast.grad_fn.name() == boxed.grad_fn.name() == "BatchrulesLinearBackward0"


class Recording(torch.Tensor):
    """A __torch_function__ subclass that records the functions it sees."""
    seen: List[Any] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_torch_function_subclasses_see_the_op() -> None:
    Recording.seen.clear()
    x = torch.randn(2, 3).as_subclass(Recording)
    out = batchrules.linear(x, torch.randn(4, 3))
    assert torch.ops.batchrules.linear.default in Recording.seen
    assert out.shape == (2, 4)


def test_missing_tensor_gets_the_kernel_message() -> None:
    try:
        batchrules.linear(torch.randn(2, 3), None)  # type: ignore[arg-type]
    except RuntimeError as e:
        assert "expected input and weight to be tensors" in str(e)
    else:
        raise AssertionError("None weight was accepted")


class RecordingMode(torch.overrides.TorchFunctionMode):
    """A __torch_function__ mode that records the functions it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: List[Any] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_torch_function_modes_see_the_op() -> None:
    x, w, b = torch.randn(2, 3), torch.randn(4, 3), torch.randn(4)
    with RecordingMode() as mode:
        out = batchrules.linear(x, w, b)
    assert mode.seen == [torch.ops.batchrules.linear.default]
    assert out.shape == (2, 4)


def test_parameters_and_keywords_take_the_fast_path() -> None:
    lin = torch.nn.Linear(3, 4)
    x = torch.randn(2, 3)
    out = batchrules.linear(input=x, weight=lin.weight, bias=lin.bias)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, lin.weight, lin.bias),
                               rtol=0, atol=0)
    assert out.grad_fn.name() == "BatchrulesLinearBackward0"


def test_non_tensor_argument_is_a_type_error() -> None:
    try:
        batchrules.linear(torch.randn(2, 3), [[1.0, 2.0, 3.0]])  # type: ignore[arg-type]
    except (RuntimeError, TypeError) as e:
        assert "weight" in str(e) or "Tensor" in str(e)
    else:
        raise AssertionError("a list weight was accepted")


def test_compile_traces_the_operator_through_the_polyfill() -> None:
    """fullgraph compile of the C entry: no graph break, the op in the graph."""
    graphs: List[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm

    fn = torch.compile(lambda x, w, b: batchrules.linear(x, w, b), backend=backend,
                       fullgraph=True)
    x, w, b = torch.randn(2, 3), torch.randn(4, 3), torch.randn(4)
    torch.testing.assert_close(fn(x, w, b), torch.nn.functional.linear(x, w, b))
    targets = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert torch.ops.batchrules.linear.default in targets


class OneLinear(torch.nn.Module):
    """An nn.Linear's parameters applied with batchrules.linear."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return batchrules.linear(x, self.lin.weight, self.lin.bias)


def test_fx_and_jit_trace_see_the_c_entry() -> None:
    """torch.fx's proxies take the torch.ops path and record the op; jit.trace records it too."""
    net, x = OneLinear(), torch.randn(2, 3)
    expected = net(x)
    traced = torch.fx.symbolic_trace(net)
    assert any(n.target is torch.ops.batchrules.linear.default for n in traced.graph.nodes)
    torch.testing.assert_close(traced(x), expected)
    scripted = torch.jit.trace(net, (x,))
    assert "batchrules::linear" in str(scripted.graph)
    torch.testing.assert_close(scripted(x), expected)


# torch.export's own pytree code warns in 2.13.
@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning")
def test_export_keeps_the_op_and_run_decompositions_lowers_it() -> None:
    net, x = OneLinear(), torch.randn(2, 3)
    exported = torch.export.export(net, (x,))
    ops = [n.target for n in exported.graph.nodes if n.op == "call_function"]
    assert ops == [torch.ops.batchrules.linear.default]
    lowered = exported.run_decompositions()
    ops = [n.target for n in lowered.graph.nodes if n.op == "call_function"]
    assert torch.ops.batchrules.linear.default not in ops and torch.ops.aten.addmm.default in ops
    torch.testing.assert_close(lowered.module()(x), net(x))
