"""Which kernel an LSTM layer runs under each flow (Note [oneDNN's LSTM layer
under transforms]), each checked against a per-example or per-member loop of
eager calls, and batchrules.fused_lstm_layer's own contract."""
from typing import Callable, Dict, Tuple

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, jacfwd, stack_module_state, vmap

import batchrules
from batchrules import _C

RECURRENCE, INFERENCE, TRAINING = ("batchrules::rnn_recurrence", "aten::mkldnn_rnn_layer",
                                   "batchrules::fused_lstm_layer")


def ran(fn: Callable[[], object]) -> Tuple[object, set]:
    with batchrules.enabled(), torch.profiler.profile() as prof:
        out = fn()
    return out, {e.key for e in prof.key_averages()}


def loss(module: nn.Module, p: Dict[str, Tensor], x: Tensor) -> Tensor:
    return functional_call(module, p, (x,))[0].square().mean()


def members(rows: int, dtype=torch.float32, hidden: int = 4):
    models = [nn.LSTM(3, hidden, batch_first=True).to(dtype) for _ in range(3)]
    params, _ = stack_module_state(models)
    return models, {k: v.detach() for k, v in params.items()}, torch.randn(rows, 5, 3, dtype=dtype)


def member_grads(models, x) -> Dict[str, Tensor]:
    rows = [torch.autograd.grad(m(x)[0].square().mean(), list(m.parameters())) for m in models]
    return {k: torch.stack([r[i] for r in rows]) for i, (k, _) in enumerate(models[0].named_parameters())}


def small_members(rows: int, hidden: int) -> bool:
    """Whether an ensemble's members take the recurrence by their size: fewer
    than 8 rows, or fewer than kMinOneDnnMemberWork = 768 rows x hidden
    on an Intel CPU (Note [oneDNN's LSTM layer under transforms])."""
    return rows < 8 or (rows * hidden < 768 and _C._intel_cpu())


@pytest.mark.parametrize("rows,hidden", [(12, 64), (10, 4), (2, 64)])
def test_ensemble_training(rows: int, hidden: int) -> None:
    # A member loop of oneDNN's fused layer and backward where each member is
    # large enough, else one bmm a step over all members.
    kernel = RECURRENCE if small_members(rows, hidden) else TRAINING
    models, params, x = members(rows, hidden=hidden)
    want = member_grads(models, x)
    got, names = ran(lambda: vmap(grad(lambda p: loss(models[0], p, x)))(params))
    assert kernel in names and ({TRAINING, RECURRENCE} - {kernel}).isdisjoint(names)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)
    summed, names = ran(lambda: grad(lambda P: vmap(lambda p: loss(models[0], p, x))(P).sum())(params))
    assert kernel in names
    for k in want:
        torch.testing.assert_close(summed[k], want[k], rtol=1e-4, atol=1e-5)


def test_nested_ensembles_split_the_workspace_list_per_level() -> None:
    # Note [The fused layer's workspace list]: 2 x 3 members, one fused call
    # each; each level's backward rule hands each member its part of the list.
    models = [nn.LSTM(3, 64, batch_first=True) for _ in range(6)]  # members not small_members
    stacked, _ = stack_module_state(models)
    params = {k: v.detach().unflatten(0, (2, 3)) for k, v in stacked.items()}
    x = torch.randn(12, 5, 3)
    per_member = vmap(vmap(grad(lambda p: loss(models[0], p, x))))
    got, names = ran(lambda: per_member(params))
    assert TRAINING in names and RECURRENCE not in names
    want = member_grads(models, x)
    for k in want:
        torch.testing.assert_close(got[k].flatten(0, 1), want[k], rtol=1e-4, atol=1e-5)


def test_cotangents_batched_alone_share_the_workspace() -> None:
    # vmap over a vjp's cotangents: the forward ran once, unbatched, so every
    # cotangent's backward reads that one call's workspace.
    model = nn.LSTM(3, 4, batch_first=True)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, cotangents = torch.randn(10, 5, 3), torch.randn(3, 10, 5, 4)

    def vjps():
        _, pullback = torch.func.vjp(lambda p: functional_call(model, p, (x,))[0], params)
        return vmap(pullback)(cotangents)[0]

    got, names = ran(vjps)
    assert TRAINING in names and RECURRENCE not in names
    for i, v in enumerate(cotangents):
        want = torch.autograd.grad(model(x)[0], list(model.parameters()), v)
        for k, w in zip(params, want):
            torch.testing.assert_close(got[k][i], w, rtol=1e-4, atol=1e-5)


def test_per_sample_gradients_take_the_recurrence() -> None:
    # oneDNN's backward sums weight gradients over its rows: per-sample ones need
    # the recurrence, whose weight gradients are one bmm per sample.
    model = nn.LSTM(3, 4, batch_first=True)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(6, 5, 3)
    got, names = ran(lambda: vmap(grad(lambda p, xi: loss(model, p, xi[None])), (None, 0))(params, x))
    assert RECURRENCE in names and TRAINING not in names
    for i, xi in enumerate(x):
        want = torch.autograd.grad(model(xi[None])[0].square().mean(), list(model.parameters()))
        for k, w in zip(params, want):
            torch.testing.assert_close(got[k][i], w, rtol=1e-4, atol=1e-5)


def test_inference_folds_into_one_fused_call() -> None:
    model = nn.LSTM(3, 4)
    x = torch.randn(6, 5, 2, 3)
    with torch.no_grad():
        got, names = ran(lambda: vmap(lambda xi: model(xi)[0])(x))
        torch.testing.assert_close(got, torch.stack([model(xi)[0] for xi in x]))
    assert INFERENCE in names and RECURRENCE not in names


@pytest.mark.parametrize("hidden,rows", [(4, 10), (64, 12)])
def test_ensemble_inference(hidden: int, rows: int) -> None:
    # A member loop of oneDNN's layer, except for small_members: one bmm a step
    # over all members.
    models = [nn.LSTM(3, hidden, batch_first=True) for _ in range(3)]
    params, _ = stack_module_state(models)
    x = torch.randn(rows, 5, 3)
    with torch.no_grad():
        got, names = ran(lambda: vmap(lambda p: functional_call(models[0], p, (x,))[0])(params))
        want = torch.stack([m(x)[0] for m in models])
    small = small_members(rows, hidden)
    assert (RECURRENCE if small else INFERENCE) in names
    assert (INFERENCE if small else RECURRENCE) not in names
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("flow", ["float64", "jacfwd"])
def test_other_flows_keep_the_recurrence_or_its_decomposition(flow: str) -> None:
    models, params, x = members(10, torch.float64 if flow == "float64" else torch.float32)
    if flow == "float64":
        _, names = ran(lambda: vmap(grad(lambda p: loss(models[0], p, x)))(params))
        assert RECURRENCE in names
    else:
        _, names = ran(lambda: jacfwd(lambda xx: models[0](xx)[0].sum())(x))
        assert not {RECURRENCE, TRAINING, INFERENCE} & names
    assert TRAINING not in names


def test_fused_lstm_layer_contract() -> None:
    torch.manual_seed(0)
    w_ih, w_hh = torch.randn(16, 3, requires_grad=True), torch.randn(16, 4, requires_grad=True)
    b_ih, b_hh = torch.randn(16, requires_grad=True), torch.randn(16, requires_grad=True)
    x, h0, c0 = torch.randn(5, 2, 3, requires_grad=True), torch.randn(2, 4), torch.randn(2, 4)
    args = (x, w_ih, w_hh, b_ih, b_hh, h0, c0, True)
    torch.library.opcheck(torch.ops.batchrules.fused_lstm_layer, args,
                          test_utils=("test_schema", "test_autograd_registration"))
    out, h_n, c_n, _ = torch.ops.batchrules.fused_lstm_layer(*args)
    ref = nn.LSTM(3, 4)
    with torch.no_grad():
        for p, v in zip(ref.parameters(), (w_ih, w_hh, b_ih, b_hh)):
            p.copy_(v)
    x_rev = x.flip(0)  # reverse: the loop runs from the last step
    ref_out, (ref_h, ref_c) = ref(x_rev, (h0[None], c0[None]))
    torch.testing.assert_close(out, ref_out.flip(0))
    torch.testing.assert_close(h_n, ref_h[0])
    torch.testing.assert_close(c_n, ref_c[0])
    got = torch.autograd.grad(out.square().sum() + h_n.sum(), (x, w_ih, w_hh, b_ih, b_hh))
    want = torch.autograd.grad(ref_out.square().sum() + ref_h.sum(),
                               (x,) + tuple(ref.parameters()))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    with pytest.raises(RuntimeError, match="float32 CPU input"):
        torch.ops.batchrules.fused_lstm_layer(x.double(), w_ih, w_hh, b_ih, b_hh, h0, c0, False)
    # Note [The fused layer's workspace list]: one call's backward reads one entry
    with torch.no_grad():
        out, h_n, c_n, ws = torch.ops.batchrules.fused_lstm_layer(*args)
    with pytest.raises(RuntimeError, match="workspace list of one fused_lstm_layer call .* 2 entries"):
        torch.ops.batchrules.fused_lstm_layer_backward(
            x.detach(), w_ih.detach(), w_hh.detach(), b_ih.detach(), b_hh.detach(), h0, c0, out,
            h_n, c_n, torch.ones_like(out), None, None, ws + ws, True)
