"""The engine's forward runs the model with its leaves in the parameters'
slots (batchrules/dp/engine/parameter_slots.py): the parameters found as
``named_parameters`` finds them, tied ones replaced together, the model's own
parameters back after the forward (also when it raises), and changes between
steps (a parameter frozen, a layer replaced) seen at the next step."""
from typing import List

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrizations

from batchrules.dp.engine import DPOptimizer, PrivateModule
from batchrules.dp.engine.parameter_slots import parameter_slots, swapped

C = 0.7


class TiedLM(nn.Module):
    """A token embedding tied to the output head, as GPT-2's ``wte`` and ``lm_head``."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(11, 6)
        self.mix = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mix(self.wte(tokens)))).mean(1)


def shared_block() -> nn.Module:
    block = nn.Linear(4, 4)
    return nn.Sequential(block, nn.Tanh(), block, nn.Linear(4, 3, bias=False))


@pytest.mark.parametrize("build", [TiedLM, shared_block,
                                   lambda: parametrizations.weight_norm(nn.Linear(4, 3))])
def test_the_parameters_named_parameters_finds(build) -> None:
    model = build()
    model.requires_grad_(True)
    next(model.parameters()).requires_grad_(False)
    slots = parameter_slots(model)
    assert [(n, id(p)) for n, p in slots.named] == [(n, id(p)) for n, p in model.named_parameters()]
    assert [n for n, _ in slots.trainable()] == [n for n, p in model.named_parameters() if p.requires_grad]
    held = {(id(m), a) for slots_of_p in slots.held_in.values() for m, a in slots_of_p}
    assert held == {(id(m), a) for m in model.modules() for a, p in m._parameters.items() if p is not None}


def test_tied_slots_replaced_together_and_restored_also_on_error() -> None:
    model = TiedLM()
    original = [(m, n, p) for m in model.modules() for n, p in m._parameters.items()]
    slots = parameter_slots(model)
    leaf = model.wte.weight.detach().clone().requires_grad_()
    with swapped(slots, [(model.wte.weight, leaf)]):
        assert model.wte.weight is leaf and model.head.weight is leaf
    with pytest.raises(RuntimeError, match="in the forward"):
        with swapped(slots, [(model.wte.weight, leaf), (model.mix.weight, leaf)]):
            raise RuntimeError("in the forward")
    assert all(m._parameters[n] is p for m, n, p in original)


def loop_reference(model: nn.Module, x: Tensor, y: Tensor) -> List[Tensor]:
    """sum_i clip_C(g_i) over the trainable parameters, one backward per sample."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for i in range(len(y)):
        loss = F.cross_entropy(model(x[i:i + 1]), y[i:i + 1], reduction="sum")
        grads = torch.autograd.grad(loss, params)
        norm = float(torch.sqrt(sum((g ** 2).sum() for g in grads)))
        for t, g in zip(total, grads):
            t += min(1.0, C / (norm + 1e-6)) * g
    return total


def engine_update(private: PrivateModule, model: nn.Module, x: Tensor, y: Tensor) -> List[Tensor]:
    """One step (noise 0, SGD lr 1, a summed loss): the trainable parameters' update."""
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    optimizer = DPOptimizer(torch.optim.SGD(params, lr=1.0), module=private, noise_multiplier=0.0,
                            max_grad_norm=C, expected_batch_size=None, loss_reduction="sum")
    optimizer.zero_grad()
    F.cross_entropy(private(x), y, reduction="sum").backward()
    optimizer.step()
    return [b - p.detach() for b, p in zip(before, params)]


def assert_step_equals_loop(private: PrivateModule, model: nn.Module, x: Tensor, y: Tensor) -> None:
    expected = loop_reference(model, x, y)
    for got, want in zip(engine_update(private, model, x, y), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_tied_and_shared_weights_clipped_once() -> None:
    """A tied embedding/head and a block used twice: one parameter, its uses summed."""
    torch.manual_seed(0)
    for model, x, y in ((TiedLM().double(), torch.randint(0, 11, (5, 7)), torch.randint(0, 11, (5,))),
                        (shared_block().double(), torch.randn(5, 4, dtype=torch.float64),
                         torch.randint(0, 3, (5,)))):
        private = PrivateModule(model, loss_reduction="sum")
        assert_step_equals_loop(private, model, x, y)
        assert all(p.grad is None or p.grad.abs().sum() > 0 for p in model.parameters())


def test_changes_between_steps_are_seen() -> None:
    """Frozen, then a layer replaced: each step clips what the model holds then."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    private = PrivateModule(model, loss_reduction="sum")
    assert_step_equals_loop(private, model, x, y)
    model[0].weight.requires_grad_(False)
    assert_step_equals_loop(private, model, x, y)
    model[2] = nn.Linear(5, 3).double()
    assert_step_equals_loop(private, model, x, y)
    assert model[2].weight.grad is not None
