"""clipped_grad pauses the cyclic garbage collector while a step runs (Note
[No cyclic collection during a step], batchrules/dp/gc_pause.py) and leaves
it as the caller had it."""
import gc
from typing import List

import pytest
import torch
from torch import nn
from torch.func import functional_call

import batchrules


def step(seen: List[bool], raise_inside: bool = False):
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, x, y):
        seen.append(gc.isenabled())
        if raise_inside:
            raise KeyError("in the loss")
        return nn.functional.mse_loss(functional_call(model, p, (x,)), y)

    return batchrules.clipped_grad(loss, 1.0), params, torch.randn(6, 4), torch.randn(6, 2)


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("raise_inside", [False, True])
def test_paused_in_the_step_and_left_as_it_was(enabled: bool, raise_inside: bool) -> None:
    seen: List[bool] = []
    clipped, params, x, y = step(seen, raise_inside)
    (gc.enable if enabled else gc.disable)()
    try:
        if raise_inside:
            with pytest.raises(KeyError, match="in the loss"):
                clipped(params, x, y)
        else:
            clipped(params, x, y)
        assert seen == [False]
        assert gc.isenabled() == enabled
    finally:
        gc.enable()


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.head = nn.LSTM(4, 8, batch_first=True), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])


def test_a_step_leaves_no_cycle_of_its_own_records() -> None:
    # What the paused collector would have had to find: a step's uses (an LSTM's
    # partners among them), params and tensors are freed by reference counting
    # (torch's pytree closures are not; nor what other tests left behind).
    model = Recurrent()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = torch.randn(6, 3, 4), torch.randn(6, 2)

    def loss(p, xi, yi):
        return nn.functional.mse_loss(functional_call(model, p, (xi[None],)), yi[None])

    clipped = batchrules.clipped_grad(loss, 1.0)
    clipped(params, x, y)
    gc.collect()
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        clipped(params, x, y)
        gc.collect()
        ours = [o for o in gc.garbage if isinstance(o, torch.Tensor)
                or (type(o).__module__ or "").startswith("batchrules")]
        assert not ours, {type(o).__name__ for o in ours}
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
