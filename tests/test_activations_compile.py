"""torch.compile of the activation ops and of vmap(grad) over SiLU networks with
routing on: AOTAutograd lowers the ops to ATen's kernels (aten.silu,
aten.silu_backward, ...; see batchrules/compile.py), graph checks with
aot_eager, one end-to-end Inductor compile."""
from typing import Dict, List

import pytest
import torch
import torch.nn.functional as F
from activation_samples import ACTS, Act
from torch import Tensor, nn
from torch._dynamo.testing import AotEagerAndRecordGraphs, CompileCounterWithBackend
from torch.func import functional_call, grad, stack_module_state, vmap

import batchrules
from batchrules import compile as compile_hooks

pytestmark = [pytest.mark.filterwarnings("ignore:Your compiler for AOTAutograd"),
              pytest.mark.usefixtures("fresh_dynamo")]


def graph_ops(graphs: List[torch.fx.GraphModule]) -> List[str]:
    return [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_decomposed_to_atens_kernels(act: Act) -> None:
    backend = AotEagerAndRecordGraphs()
    x = torch.randn(4, 5, requires_grad=True)
    out = torch.compile(lambda t: act.op(t).sum(), fullgraph=True, backend=backend)(x)
    (got,) = torch.autograd.grad(out, x)
    fw, bw = graph_ops(backend.fw_graphs), graph_ops(backend.bw_graphs)
    assert f"aten.{act.name}.default" in fw, fw
    assert not [op for op in fw + bw if op.startswith("batchrules")], fw + bw
    assert f"aten.{act.name}_backward.default" in bw, bw
    (want,) = torch.autograd.grad(act.stock(x).sum(), x)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_extern_kernels_keep_the_ops(act: Act) -> None:
    compile_hooks.unregister_decompositions()
    try:
        backend = AotEagerAndRecordGraphs()
        x = torch.randn(4, 5, requires_grad=True)
        out = torch.compile(lambda t: act.op(t).sum(), fullgraph=True, backend=backend)(x)
        out.backward()
    finally:
        compile_hooks.register_decompositions()
    assert f"batchrules.{act.name}.default" in graph_ops(backend.fw_graphs)
    assert f"batchrules.{act.name}_backward.default" in graph_ops(backend.bw_graphs)


@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_dynamic_shapes_one_graph(act: Act) -> None:
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda g, t: act.backward(g, t) * 2, fullgraph=True,
                             backend=counter, dynamic=True)
    for rows in (3, 7, 11):
        g, x = torch.randn(rows, 4), torch.randn(rows, 4)
        torch.testing.assert_close(compiled(g, x), act.stock_backward(g, x) * 2)
    assert counter.frame_count == 1


def ensemble(act: Act):
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(5, 8), act.module(), nn.Linear(8, 3)) for _ in range(3)]
    params, buffers = stack_module_state(models)
    base = models[0]

    def loss(p: Dict[str, Tensor], b: Dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        return F.mse_loss(functional_call(base, (p, b), (x,)), y)

    x, y = torch.randn(3, 4, 5), torch.randn(3, 4, 3)
    loop = [torch.autograd.grad(F.mse_loss(m(x[i]), y[i]), list(m.parameters()))
            for i, m in enumerate(models)]
    want = {k: torch.stack([r[j] for r in loop]) for j, k in enumerate(params)}
    params = {k: v.detach() for k, v in params.items()}
    return vmap(grad(loss)), (params, buffers, x, y), want


@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_vmap_grad_fullgraph_routed(act: Act, routing_on: None) -> None:
    """The whole per-member gradient step in one graph, whose backward runs ATen's
    one-kernel <act>_backward instead of the create_graph composite."""
    step, args, want = ensemble(act)
    backend = AotEagerAndRecordGraphs()
    got = torch.compile(step, fullgraph=True, backend=backend)(*args)
    for k in want:
        torch.testing.assert_close(got[k], want[k])
    ops = graph_ops(backend.fw_graphs)
    assert ops.count(f"aten.{act.name}_backward.default") == 1, ops
    assert "aten.sigmoid.default" not in ops, ops
    with batchrules.enabled(False):
        torch._dynamo.reset()
        stock_backend = AotEagerAndRecordGraphs()
        torch.compile(step, fullgraph=True, backend=stock_backend)(*args)
    assert graph_ops(stock_backend.fw_graphs) != ops


# slow: Inductor compiles and builds C++; the one end-to-end Inductor run of the activations.
@pytest.mark.slow
def test_vmap_grad_inductor(routing_on: None) -> None:
    step, args, want = ensemble(ACTS[0])
    counter = CompileCounterWithBackend("inductor")
    got = torch.compile(step, fullgraph=True, backend=counter)(*args)
    for k in want:
        torch.testing.assert_close(got[k], want[k])
    assert counter.frame_count == 1
