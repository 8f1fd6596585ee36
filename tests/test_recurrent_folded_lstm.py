"""vmap over nn.LSTM on per-sample sequences with shared weights, vmap alone:
aten's LSTM once over the vmap dim folded into its rows (Note [An LSTM over
per-sample sequences as one eager call]). float32 on the CPU (where oneDNN runs
it), against a loop of stock eager calls; which path ran is read from the
profiler: the folded call is aten::lstm called again below the route."""
import functools
from typing import Callable

import pytest
import torch
from conftest import assert_close
from recurrent_reference import (
    HIDDEN,
    IN,
    RNN_CASES,
    B,
    N,
    T,
    batched,
    call,
    ensemble,
    input_shape,
    loop,
    make_hx,
    make_rnn,
    routed,
)
from torch.func import functional_call, grad, vmap

F32 = torch.float32
TOL = {"rtol": 1e-5, "atol": 1e-6}
# More samples than per-sample rows N, so that folding samples and rows in the
# wrong order changes the values.
SAMPLES = N + 1
# Every layout but the projections (oneDNN's layer has none: not folded).
FOLDED_CASES = {name: case for name, case in RNN_CASES.items() if "proj_size" not in case[0]}


def lstm_calls(fn: Callable[[], object]) -> int:
    """How many aten::lstm calls fn made: one per routed call, two where it folded."""
    with torch.profiler.profile() as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "aten::lstm")


@pytest.mark.parametrize("options,per_example_batch,hx_spec,x_dim", FOLDED_CASES.values(),
                         ids=FOLDED_CASES)
@pytest.mark.parametrize("grad_mode", [True, False], ids=["grad_mode", "no_grad"])
def test_folds_into_one_eager_call(options, per_example_batch, hx_spec, x_dim, grad_mode) -> None:
    module = make_rnn("lstm", F32, **options)
    x = batched(input_shape(module, per_example_batch), x_dim, F32, SAMPLES)
    hx, hx_dims = make_hx(module, per_example_batch, hx_spec, F32, SAMPLES)
    with routed(), torch.set_grad_enabled(grad_mode):
        run = functools.partial(vmap(call(module), in_dims=(x_dim, hx_dims)), x, hx)
        got = run()
        assert lstm_calls(run) == 2
    assert_close(got, loop(call(module), (x, hx), (x_dim, hx_dims), SAMPLES), **TOL)


def test_eval_mode_dropout_folds_and_training_dropout_does_not() -> None:
    # Dropout between layers in training is vmap's randomness to decide: not folded.
    module = make_rnn("lstm", F32, num_layers=2, dropout=0.5).eval()
    x = batched(input_shape(module, True), 0, F32)
    with routed():
        assert lstm_calls(lambda: vmap(module)(x)) == 2
        assert_close(vmap(module)(x), loop(module, (x,), (0,)), **TOL)
        module.train()
        assert lstm_calls(lambda: vmap(module, randomness="different")(x)) == 1
        with pytest.raises(RuntimeError, match="randomness"):
            vmap(module)(x)


def test_autograd_outside_the_vmap_reaches_the_weights() -> None:
    # Weights requiring grad, the loss taken after the vmap: aten's own
    # backward of the folded call, summed over the samples.
    module = make_rnn("lstm", F32, num_layers=2)
    x = batched(input_shape(module, False), 0, F32)
    with routed():
        out, (h_n, c_n) = vmap(module)(x)
        (out.sin().sum() + h_n.sum() + c_n.square().sum()).backward()
    got = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    out, (h_n, c_n) = module(x.transpose(0, 1))  # the folded eager call, batch in dim 1
    (out.sin().sum() + h_n.sum() + c_n.square().sum()).backward()
    for g, p in zip(got, module.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("flow", ["ensemble", "vmap_grad", "nested_vmap", "float64"])
def test_other_flows_do_not_fold(flow: str) -> None:
    module = make_rnn("lstm", torch.float64 if flow == "float64" else F32)
    x = batched(input_shape(module, True), 0, next(module.parameters()).dtype)
    if flow == "ensemble":
        members, params, buffers, fn = ensemble(lambda: make_rnn("lstm", F32))
        run = functools.partial(vmap(fn, in_dims=(0, 0, None)), params, buffers, x[0])
    elif flow == "vmap_grad":
        params = {k: v.detach() for k, v in module.named_parameters()}
        loss = lambda p, xi: functional_call(module, p, (xi,))[0].sum()  # noqa: E731
        run = functools.partial(vmap(grad(loss), in_dims=(None, 0)), params, x)
    elif flow == "nested_vmap":
        run = functools.partial(vmap(vmap(module)), x.unsqueeze(0))
    else:
        run = functools.partial(vmap(module), x)
    with routed():
        run()
        assert lstm_calls(run) == 1


def test_bad_states_name_the_per_sample_shapes() -> None:
    module = make_rnn("lstm", F32)
    x = batched([T, N, IN], 0, F32)

    def lstm(xi, hi, ci):
        return torch._VF.lstm(xi, (hi, ci), module._flat_weights, True, 1, 0.0, False, False,
                              False)

    h, c = torch.zeros(B, 1, N, HIDDEN), torch.zeros(B, 1, N, HIDDEN)
    with routed():
        with pytest.raises(RuntimeError, match=rf"hidden state of shape \[1, {N}, {HIDDEN}\], "
                                               rf"but got \[1, {N + 1}, {HIDDEN}\]"):
            vmap(lstm)(x, torch.zeros(B, 1, N + 1, HIDDEN), c)
        with pytest.raises(RuntimeError, match=rf"cell state of shape \[1, {N}, {HIDDEN}\], "
                                               rf"but got \[1, {N + 1}, {HIDDEN}\]"):
            vmap(lstm)(x, h, torch.zeros(B, 1, N + 1, HIDDEN))
