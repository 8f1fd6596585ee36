"""Recurrent layers under grad-based transforms against stock eager autograd.

Per-sample gradients (weights, input, h0/c0), an ensemble's summed loss,
jacrev, jacfwd (stock fails on oneDNN's float32 LSTM layer, routed must not)
and second derivatives, routed; references are float64 loops of
torch.autograd on stock eager calls, one example at a time.
"""
import copy
import functools

import pytest
import torch
from conftest import assert_close, params_of
from recurrent_reference import (
    KINDS,
    PROJ,
    B,
    batched,
    call,
    ensemble,
    example_args,
    input_shape,
    leaves_like,
    make_cell,
    make_hx,
    make_rnn,
    routed,
    scalar,
    stack,
)
from torch import nn
from torch.autograd.functional import jacobian
from torch.func import functional_call, grad, jacfwd, jacrev, vmap
from torch.utils._pytree import tree_map

import batchrules

MODULES = {  # name: builder of a float64 module
    "one_layer": lambda kind: make_rnn(kind),
    "two_layers_bidirectional": lambda kind: make_rnn(kind, num_layers=2, bidirectional=True),
    "batch_first_no_bias": lambda kind: make_rnn(kind, batch_first=True, bias=False),
    "cell": lambda kind: make_cell(kind),
    "proj_two_layers": lambda kind: make_rnn(kind, proj_size=PROJ, num_layers=2),
}
PARAMS = [pytest.param(kind, name, id=f"{kind}-{name}") for kind in KINDS for name in MODULES
          if kind == "lstm" or not name.startswith("proj")]


def first(output):
    """The output sequence (or a cell's h'), the part of the output Jacobians are taken of."""
    return output[0] if isinstance(output, tuple) else output


def module_and_input(kind: str, name: str, per_example_batch: bool = True):
    module = MODULES[name](kind)
    return module, batched(input_shape(module, per_example_batch), 0)


def eager_grads(module: nn.Module, x, hx, wrt: str):
    """One example's gradients of ``scalar`` by stock autograd: w.r.t. the
    parameters (a dict) or w.r.t. (x, hx)."""
    with batchrules.enabled(False):
        if wrt == "params":
            p = leaves_like(params_of(module))
            loss = scalar(functional_call(module, p, (x,) if hx is None else (x, hx)))
            return dict(zip(p, torch.autograd.grad(loss, list(p.values()))))
        x, hx = leaves_like((x, hx))
        states = list(hx) if isinstance(hx, tuple) else [hx]
        gx, *gh = torch.autograd.grad(scalar(call(module)(x, hx)), [x, *states])
        return gx, (tuple(gh) if isinstance(hx, tuple) else gh[0])


@pytest.mark.parametrize("kind,name", PARAMS)
@pytest.mark.parametrize("per_example_batch", [False, True], ids=["x_unbatched", "x_batched"])
def test_per_sample_param_grads(kind, name, per_example_batch) -> None:
    module, x = module_and_input(kind, name, per_example_batch)

    def loss(p, x):
        return scalar(functional_call(module, p, (x,)))

    with routed():
        got = vmap(grad(loss), in_dims=(None, 0))(params_of(module), x)
    assert_close(got, stack([eager_grads(module, x[i], None, "params") for i in range(B)]))


@pytest.mark.parametrize("kind,name", PARAMS)
@pytest.mark.parametrize("hx_spec", ["batched", "shared"])
def test_per_sample_input_and_hidden_grads(kind, name, hx_spec) -> None:
    module, x = module_and_input(kind, name)
    hx, hx_dims = make_hx(module, True, hx_spec)
    with routed():
        got = vmap(grad(lambda x, hx: scalar(call(module)(x, hx)), argnums=(0, 1)),
                   in_dims=(0, hx_dims))(x, hx)
    want = stack([eager_grads(module, *example_args((x, hx), (0, hx_dims), i), "input")
                  for i in range(B)])
    assert_close(got, want)


@pytest.mark.parametrize("kind,name", PARAMS)
def test_ensemble_summed_loss_grad(kind, name) -> None:
    members, params, buffers, fn = ensemble(functools.partial(MODULES[name], kind))
    x = batched(input_shape(members[0], True), None)  # one minibatch for every member

    def total(p):
        return vmap(lambda p, b: scalar(fn(p, b, x)))(p, buffers).sum()

    with routed():
        got = grad(total)(params)
    assert_close(got, stack([eager_grads(m, x, None, "params") for m in members]))


@pytest.mark.parametrize("kind,name", PARAMS)
def test_jacrev_wrt_input_and_h0(kind, name) -> None:
    module, x = module_and_input(kind, name)
    x0 = x[0]
    hx = tree_map(lambda t: t[0], make_hx(module, True, "batched")[0])
    out = lambda x, hx: first(call(module)(x, hx))  # noqa: E731
    with routed():
        got = jacrev(out, argnums=(0, 1))(x0, hx)
    with batchrules.enabled(False):
        if isinstance(hx, tuple):
            gx, *gh = jacobian(lambda x, *hx: out(x, tuple(hx)), (x0, *hx))
            want = (gx, tuple(gh))
        else:
            want = jacobian(out, (x0, hx))
    assert_close(got, want)


@pytest.mark.parametrize("kind,name", PARAMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_jacfwd_wrt_input(kind, name, dtype) -> None:
    # Stock jacfwd over a float32 nn.LSTM raises (no forward AD for
    # mkldnn_rnn_layer); routed, every kind and dtype has one.
    module, x = module_and_input(kind, name)
    reference = copy.deepcopy(module.to(dtype)).double()  # the same rounded weights
    x0 = x[0].to(dtype)
    with routed():
        got = jacfwd(lambda x: first(module(x)))(x0)
    with batchrules.enabled(False):
        want = jacobian(lambda x: first(reference(x)), x0.double())
    assert_close(got, want.to(dtype), **({} if dtype == torch.float64 else
                                         {"atol": 1e-4, "rtol": 1e-4}))


@pytest.mark.parametrize("kind,name", PARAMS)
def test_second_order_hvp(kind, name) -> None:
    # grad(grad) w.r.t. input and weights works stock (double backward of the
    # native cells); routed it must too, with the same values.
    module, x = module_and_input(kind, name)
    x0, p = x[0], params_of(module)
    v_x = torch.randn_like(x0)
    v_p = tree_map(torch.randn_like, p)

    def loss(x, p):
        return scalar(functional_call(module, p, (x,)))

    def hvp(x, p):
        gx, gp = grad(loss, argnums=(0, 1))(x, p)
        return (gx * v_x).sum() + sum((gp[k] * v_p[k]).sum() for k in gp)

    with routed():
        got = grad(hvp, argnums=(0, 1))(x0, p)
    with batchrules.enabled(False):
        xl, pl = leaves_like((x0, p))
        gx, *gp = torch.autograd.grad(loss(xl, pl), [xl, *pl.values()], create_graph=True)
        inner = (gx * v_x).sum() + sum((g * v_p[k]).sum() for g, k in zip(gp, pl))
        hx_, *hp = torch.autograd.grad(inner, [xl, *pl.values()])
    assert_close(got, (hx_, dict(zip(pl, hp))))


@pytest.mark.parametrize("kind", KINDS)
def test_per_sample_hvp(kind) -> None:
    # vmap over a second-order grad: the recurrence's double backward batched.
    module, x = module_and_input(kind, "one_layer")
    v = torch.randn_like(x)

    def hvp(x, v):
        return grad(lambda x: (grad(lambda x: scalar(module(x)))(x) * v).sum())(x)

    with routed():
        got = vmap(hvp)(x, v)
    want = []
    with batchrules.enabled(False):
        for i in range(B):
            xl = x[i].clone().requires_grad_(True)
            (gx,) = torch.autograd.grad(scalar(module(xl)), xl, create_graph=True)
            want.append(torch.autograd.grad((gx * v[i]).sum(), xl)[0])
    assert_close(got, torch.stack(want))

