"""The engine's leaves kept across forwards (Note [Leaves kept across forwards])
and routing turned on only for its per-call vmaps (Note [Routing only for the
per-call vmaps])."""
import copy
import gc
import io
import weakref
from typing import List, Tuple

import pytest
import torch
import torch.nn.functional as F
from test_dp_engine_parameter_slots import C, assert_step_equals_loop
from torch import Tensor, nn

import batchrules
from batchrules import routing
from batchrules.dp.engine import DPOptimizer, PrivateModule


def in_engine(model: nn.Module) -> bool:
    """Whether ``model`` runs in the engine's forward (its leaves in place of its parameters)."""
    return not isinstance(model[0].weight, nn.Parameter)


def weights_seen(model: nn.Module) -> List[Tensor]:
    """The tensors the model's first layer holds as its weight during each engine forward."""
    seen: List[Tensor] = []
    model[0].register_forward_hook(
        lambda m, args, out: seen.append(m.weight) if in_engine(model) else None)
    return seen


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def watched_step() -> Tuple[nn.Module, Tensor, Tensor, PrivateModule, List[Tensor]]:
    """An MLP, a batch, its PrivateModule and the weights it is seen to hold,
    after one step checked against the per-sample loop."""
    torch.manual_seed(0)
    model = mlp()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    private = PrivateModule(model, loss_reduction="sum", validate=False)
    seen = weights_seen(model)
    assert_step_equals_loop(private, model, x, y)
    return model, x, y, private, seen


def test_a_leaf_is_kept_while_its_parameter_holds_the_same_data() -> None:
    model, x, y, private, seen = watched_step()
    assert_step_equals_loop(private, model, x, y)  # reads the first step's in-place update
    assert len(seen) == 2 and seen[0] is seen[1]
    model[0].weight.data = model[0].weight.data.clone()
    assert_step_equals_loop(private, model, x, y)
    assert seen[2] is not seen[1]
    model.float()
    assert_step_equals_loop(private, model.double(), x, y)
    assert seen[3] is not seen[2] and seen[3].dtype == torch.float64


def test_moving_the_module_lets_the_previous_leaves_go() -> None:
    model, x, y, private, seen = watched_step()
    leaf = weakref.ref(seen.pop())
    private.float()
    gc.collect()
    assert leaf() is None  # no view of the float64 data held
    private.double()
    assert_step_equals_loop(private, model, x, y)


def test_a_copy_or_a_pickle_of_the_module_keeps_no_leaves() -> None:
    torch.manual_seed(0)
    model = mlp()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    private = PrivateModule(model, loss_reduction="sum", validate=False)
    assert_step_equals_loop(private, model, x, y)
    buffer = io.BytesIO()
    torch.save(private, buffer)
    buffer.seek(0)
    for copied in (copy.deepcopy(private), torch.load(buffer, weights_only=False)):
        module = copied._module
        assert_step_equals_loop(copied, module, x, y)
        assert all(p.grad is not None for p in module.parameters())


class MaybeTransposed(nn.Linear):
    """``x @ W^T`` (a call the batched forward cannot split) where ``escape``
    says so, plus the linear layer itself where ``also_linear`` does."""

    escape = also_linear = False

    def forward(self, x: Tensor) -> Tensor:
        if not self.escape:
            return F.linear(x, self.weight, self.bias)
        out = x @ self.weight.t()
        return out + F.linear(x, self.weight, self.bias) if self.also_linear else out


@pytest.mark.parametrize("also_linear", [False, True])
def test_an_escape_is_reported_at_every_backward_then_forgotten(also_linear: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(MaybeTransposed(4, 3)).double()
    model[0].also_linear = also_linear
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    private = with_optimizer(model)
    model[0].escape = True
    for _ in range(2):
        loss = F.cross_entropy(private(x), y, reduction="sum")
        with pytest.raises(RuntimeError, match=r"0\.weight reached the loss through a call that"):
            loss.backward()
    model[0].escape = False
    assert_step_equals_loop(private, model, x, y)


class Scaled(nn.Module):
    """``x * s``: a call no rule takes, run under a per-call vmap."""

    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.ones(5, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.s


def routing_states(model: nn.Module) -> List[bool]:
    """Whether routing is on after each module of ``model`` runs, in order,
    in the engine's forwards."""
    states: List[bool] = []
    for m in model:
        m.register_forward_hook(
            lambda *_: states.append(routing.is_enabled()) if in_engine(model) else None)
    return states


def test_routing_is_on_from_the_first_per_call_vmap_to_the_forwards_end() -> None:
    with batchrules.enabled(False):  # whatever earlier tests in this process left
        torch.manual_seed(0)
        assert not routing.is_enabled()
        x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
        model = mlp()  # every call on the plain batch: no vmap, no routing
        states = routing_states(model)
        assert_step_equals_loop(PrivateModule(model, loss_reduction="sum", validate=False), model, x, y)
        assert states == [False, False, False] and not routing.is_enabled()

        model = nn.Sequential(nn.Linear(4, 5), Scaled(), nn.Linear(5, 3)).double()
        states = routing_states(model)
        assert_step_equals_loop(PrivateModule(model, loss_reduction="sum", validate=False), model, x, y)
        assert states == [False, True, True] and not routing.is_enabled()

        private = with_optimizer(model)
        model[2].register_forward_hook(lambda *_: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            private(x)
        assert not routing.is_enabled()
        with batchrules.enabled():  # the user's own setting is kept
            with_optimizer(model[:2])(x)
            assert routing.is_enabled()


def with_optimizer(model: nn.Module) -> PrivateModule:
    private = PrivateModule(model, loss_reduction="sum", validate=False)
    DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), module=private, noise_multiplier=0.0,
                max_grad_norm=C, expected_batch_size=None, loss_reduction="sum")
    return private
