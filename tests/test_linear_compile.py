"""torch.compile of batchrules.linear and of the torch.func flows that use it.

Inductor compiles are slow on small CI machines, so the graphs are tiny and
only the end-to-end checks use Inductor; graph-content checks use aot_eager,
which runs the same AOTAutograd tracing (and so the same decompositions).
"""
import copy
from typing import Callable, Dict, Iterator, List, Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.testing import AotEagerAndRecordGraphs, CompileCounterWithBackend
from torch.func import functional_call, grad, stack_module_state, vmap

import batchrules
from batchrules import compile as compile_hooks

# aot_eager's compiled functions take unboxed arguments; AOTAutograd says so.
pytestmark = [pytest.mark.filterwarnings("ignore:Your compiler for AOTAutograd"),
              pytest.mark.usefixtures("fresh_dynamo")]


@pytest.fixture
def extern_kernels() -> Iterator[None]:
    """Compile the batchrules ops as extern kernels instead of decomposing them."""
    compile_hooks.unregister_decompositions()
    try:
        yield
    finally:
        compile_hooks.register_decompositions()


def graph_ops(graphs: List[torch.fx.GraphModule]) -> List[str]:
    return [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]


def linear_loss(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return batchrules.linear(x, w, b).tanh().sum()


def check_grads_match(compiled: Callable, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                      dynamic_dim: Optional[int] = None) -> None:
    """Value and gradients of ``compiled`` vs eager F.linear (``dynamic_dim``:
    mark that dim of the input dynamic)."""
    leaves = [t.detach().requires_grad_() for t in (x, w, b)]
    if dynamic_dim is not None:
        torch._dynamo.mark_dynamic(leaves[0], dynamic_dim)
    ref_leaves = [t.detach().requires_grad_() for t in (x, w, b)]
    out = compiled(*leaves)
    out.backward()
    ref = F.linear(*ref_leaves).tanh().sum()
    ref.backward()
    torch.testing.assert_close(out, ref)
    for got, want in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad, want.grad)


# slow (like each Inductor test here): Inductor compiles and builds C++ for the graph;
# these are the end-to-end checks that the compiled code computes the right values.
@pytest.mark.slow
def test_inductor_forward_backward_fullgraph() -> None:
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(linear_loss, fullgraph=True, backend=counter)
    check_grads_match(compiled, torch.randn(4, 6), torch.randn(5, 6), torch.randn(5))
    assert counter.frame_count == 1


@pytest.mark.slow
@pytest.mark.parametrize("how", ["dynamic=True", "mark_dynamic"])
def test_inductor_dynamic_shapes_one_graph(how: str) -> None:
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(linear_loss, fullgraph=True, backend=counter,
                             dynamic=True if how == "dynamic=True" else None)
    w, b = torch.randn(5, 6), torch.randn(5)
    for rows in (3, 7, 11):
        check_grads_match(compiled, torch.randn(2, rows, 6), w, b,
                          dynamic_dim=1 if how == "mark_dynamic" else None)
    assert counter.frame_count == 1


@pytest.mark.parametrize("x_shape,w_shape,b_shape", [
    ((6,), (5, 6), (5,)),          # 1-D input
    ((2, 3, 6), (5, 6), (1, 5)),   # N-D input, broadcast bias
    ((3, 6), (6,), None),          # 1-D weight, no bias
    ((2, 3, 6), (6,), ()),         # 1-D weight, scalar bias
])
def test_aot_shapes_match_eager(x_shape, w_shape, b_shape) -> None:
    x, w = torch.randn(x_shape, requires_grad=True), torch.randn(w_shape, requires_grad=True)
    b = None if b_shape is None else torch.randn(b_shape, requires_grad=True)
    leaves = [t for t in (x, w, b) if t is not None]

    def f(x, w, b):
        return batchrules.linear(x, w, b).sin().sum()

    out = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True)(x, w, b)
    got = torch.autograd.grad(out, leaves)
    ref = F.linear(x, w, b).sin().sum()
    want = torch.autograd.grad(ref, leaves)
    torch.testing.assert_close(out, ref)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r)


def test_decomposed_graphs_are_plain_aten() -> None:
    backend = AotEagerAndRecordGraphs()
    x, w, b = (torch.randn(4, 6, requires_grad=True), torch.randn(5, 6, requires_grad=True),
               torch.randn(5, requires_grad=True))
    torch.compile(linear_loss, fullgraph=True, backend=backend)(x, w, b).backward()
    fw, bw = graph_ops(backend.fw_graphs), graph_ops(backend.bw_graphs)
    assert "aten.addmm.default" in fw
    assert bw.count("aten.mm.default") == 2
    assert not [op for op in fw + bw if op.startswith("batchrules")]


def test_extern_graphs_keep_the_ops(extern_kernels: None) -> None:
    backend = AotEagerAndRecordGraphs()
    x, w = torch.randn(4, 6), torch.randn(5, 6, requires_grad=True)
    b = torch.randn(5, requires_grad=True)
    torch.compile(linear_loss, fullgraph=True, backend=backend)(x, w, b).backward()
    assert graph_ops(backend.fw_graphs).count("batchrules.linear.default") == 1
    assert graph_ops(backend.bw_graphs).count("batchrules.linear_backward.default") == 1


@pytest.mark.parametrize("x_shape,w_shape,b_shape", [
    ((3,), (3,), (1,)),             # 1-D input and weight, bias with the extra leading 1
    ((2, 4, 3), (3,), (1,)),        # biases at::linear rejects for some layouts
    ((2, 4, 3), (5, 3), (4, 5)),
    ((2, 4, 3), (5, 3), (1, 1, 5)),
])
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_decomposition_is_the_kernel(x_shape, w_shape, b_shape, dtype) -> None:
    """The traced decomposition computes what the eager kernel does, also for
    the biases the kernel adds itself (Note [Biases at::linear rejects by layout])."""
    args = [torch.randn(s, dtype=dtype, requires_grad=True) for s in (x_shape, w_shape, b_shape)]

    def f(x, w, b):
        return batchrules.linear(x, w, b)

    got = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True)(*args)
    want = f(*args)
    torch.testing.assert_close(got, want)
    g = torch.randn_like(want)
    for a, e in zip(torch.autograd.grad(got, args, g), torch.autograd.grad(want, args, g)):
        torch.testing.assert_close(a, e)


def test_dynamo_keeps_shape_errors() -> None:
    compiled = torch.compile(lambda x, w: batchrules.linear(x, w), backend="aot_eager")
    with pytest.raises(Exception, match=r"input and weight shapes cannot be multiplied"):
        compiled(torch.randn(3, 4), torch.randn(5, 6))


# ---- torch.func flows under compile ---------------------------------------------

def small_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def ensemble_fn(models: List[nn.Module]) -> Callable[..., torch.Tensor]:
    """The torch.func model-ensembling recipe (stack_module_state + vmap)."""
    base = copy.deepcopy(models[0]).to("meta")

    def one(params, buffers, x):
        return functional_call(base, (params, buffers), (x,))

    def ensemble(params, buffers, x):
        return vmap(one, in_dims=(0, 0, None))(params, buffers, x)

    return ensemble


def per_sample_grads_fn(model: nn.Module) -> Callable[..., Dict[str, torch.Tensor]]:
    """The torch.func per-sample-gradient recipe: vmap(grad(loss), (None, 0, 0))."""
    def loss(params, x, y):
        out = functional_call(model, params, (x.unsqueeze(0),))
        return F.cross_entropy(out, y.unsqueeze(0))

    def per_sample_grads(params, x, y):
        return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)

    return per_sample_grads


def loop_per_sample_grads(model: nn.Module, x: torch.Tensor,
                          y: torch.Tensor) -> Dict[str, torch.Tensor]:
    names, params = zip(*model.named_parameters())
    rows = [torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), params)
            for i in range(len(x))]
    return {n: torch.stack([r[k] for r in rows]) for k, n in enumerate(names)}


@pytest.mark.parametrize("routing", [pytest.param(True, marks=pytest.mark.slow), False],
                         ids=["routing", "stock"])  # routing: Inductor
def test_compiled_ensemble(routing: bool) -> None:
    """Compiled ensembling matches a loop over the models, with routing on and
    STOCK torch.func (routing off). pytorch#109025 ("Batching rule not
    implemented for aten::t" for this recipe under torch.compile) does not
    reproduce with torch 2.13: stock works; this records that."""
    torch.manual_seed(0)
    models = [small_mlp() for _ in range(3)]
    params, buffers = stack_module_state(models)
    x = torch.randn(4, 6)
    want = torch.stack([m(x) for m in models])
    backend = "inductor" if routing else "aot_eager"
    with batchrules.enabled(routing):
        got = torch.compile(ensemble_fn(models), fullgraph=True, backend=backend)(
            params, buffers, x)
    torch.testing.assert_close(got, want)


def test_stock_issue_109025_repro_compiles() -> None:
    """The exact #109025 repro (allow_in_graph around the vmapped ensemble of
    1-D inputs) with routing off: observed to work with torch 2.13."""
    torch.manual_seed(0)
    models = [nn.Linear(3, 5) for _ in range(5)]
    params, buffers = stack_module_state(models)
    x = torch.randn(3)
    base = copy.deepcopy(models[0]).to("meta")
    traced = torch._dynamo.allow_in_graph(vmap(
        lambda p, b, x: functional_call(base, (p, b), (x,)), in_dims=(0, 0, None)))
    with batchrules.enabled(False):
        got = torch.compile(lambda p, b, x: traced(p, b, x), backend="aot_eager")(
            params, buffers, x)
    torch.testing.assert_close(got, torch.stack([m(x) for m in models]))


@pytest.mark.parametrize("routing", [pytest.param(True, marks=pytest.mark.slow), False],
                         ids=["routing", "stock"])  # routing: Inductor
def test_compiled_per_sample_grads(routing: bool) -> None:
    torch.manual_seed(0)
    model = small_mlp()
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    params = {k: v.detach() for k, v in model.named_parameters()}
    backend = "inductor" if routing else "aot_eager"
    with batchrules.enabled(routing):
        got = torch.compile(per_sample_grads_fn(model), fullgraph=True, backend=backend)(
            params, x, y)
    want = loop_per_sample_grads(model, x, y)
    for name in want:
        torch.testing.assert_close(got[name], want[name])


@pytest.mark.parametrize("routing", [True, False], ids=["routing", "stock"])
def test_routing_decides_what_compile_traces(routing: bool, extern_kernels: None) -> None:
    """Under compile the transforms run during AOTAutograd tracing, so routing
    (as set while compiling) decides whether the batchrules ops are traced."""
    torch.manual_seed(0)
    model = small_mlp()
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    params = {k: v.detach() for k, v in model.named_parameters()}
    backend = AotEagerAndRecordGraphs()
    with batchrules.enabled(routing):
        torch.compile(per_sample_grads_fn(model), fullgraph=True, backend=backend)(params, x, y)
    traced = [op for op in graph_ops(backend.fw_graphs) if op.startswith("batchrules")]
    assert bool(traced) == routing


def test_batched_weight_traced_as_bmm_and_add() -> None:
    """See Note [GEMM and bias apart when traced]: eager vmap over batched
    weights runs one baddbmm, the compiled graph bmm + add (which Inductor fuses
    with what follows), with the same values."""
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 4, 6), torch.randn(3, 5, 6), torch.randn(3, 5)

    def ensemble_forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return vmap(lambda xi, wi, bi: F.linear(xi, wi, bi).relu())(x, w, b)

    backend = AotEagerAndRecordGraphs()
    with batchrules.enabled():
        got = torch.compile(ensemble_forward, fullgraph=True, backend=backend)(x, w, b)
        with torch.profiler.profile() as prof:
            eager = ensemble_forward(x, w, b)
    fw = graph_ops(backend.fw_graphs)
    assert "aten.bmm.default" in fw and "aten.add.Tensor" in fw and "aten.baddbmm.default" not in fw
    assert "aten::baddbmm" in {e.name for e in prof.events()}
    torch.testing.assert_close(got, eager)
    torch.testing.assert_close(got, torch.einsum("bni,boi->bno", x, w).add(b[:, None]).relu())
