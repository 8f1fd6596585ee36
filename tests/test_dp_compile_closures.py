"""What clipped_grad's loss closes over, under torch.compile: the modules'
frozen parameters and buffers and the closure's tensors are inputs of the
graph, so Inductor compiles them and later changes are seen (Note [What the
loss closes over] in dp/compiled_step.py)."""
import functools
import types
from typing import Any, Callable, Dict, Tuple

import pytest
import torch
import torch.nn.functional as F
from dp_reference import assert_close_rel
from torch import Tensor, nn
from torch.func import functional_call

import batchrules
from batchrules.dp.compiled_step import closed_over

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Frozen(nn.Module):
    """A frozen embedding and linear (a LoRA-like base), a trained head, a buffer."""

    def __init__(self, rnn: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6).requires_grad_(False)
        self.body = nn.GRU(6, 6, batch_first=True) if rnn else nn.Linear(6, 6)
        self.body.requires_grad_(False)
        self.head = nn.Linear(6, 3)
        self.register_buffer("scale", torch.full((6,), 0.5))

    def forward(self, x: Tensor) -> Tensor:
        h = self.emb(x)
        h = self.body(h)[0] if isinstance(self.body, nn.GRU) else self.body(h)
        return self.head(h.mean(1) * self.scale)


def _trained(model: nn.Module) -> Dict[str, Tensor]:
    return {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}


def _batch(batch: int = 6) -> Tuple[Tensor, Tensor]:
    return torch.randint(11, (batch, 4)), torch.randint(3, (batch,))


def _assert_compiled_tracks_eager(clipped: Callable[..., Any], params: Dict[str, Tensor],
                                  change: Callable[[], None], backend: str = "inductor") -> None:
    """Compiled equals eager, and again after ``change`` (of what the loss closes over)."""
    compiled = torch.compile(clipped, fullgraph=True, backend=backend)
    x, y = _batch()
    torch.testing.assert_close(compiled(params, x, y), clipped(params, x, y), rtol=1e-4, atol=1e-5)
    before = clipped(params, x, y)
    change()
    after = clipped(params, x, y)
    assert not torch.allclose(before[1], after[1]), "the change must change the norms"
    torch.testing.assert_close(compiled(params, x, y), after, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("how", ["in_place", "replaced", "buffer"])
def test_a_frozen_base_reached_through_functional_call(how: str) -> None:
    """LoRA's case: the loss reaches the frozen parameters through the model."""
    torch.manual_seed(0)
    model = Frozen()

    def loss(p: Dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return F.cross_entropy(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    def change() -> None:
        with torch.no_grad():
            if how == "in_place":
                model.body.weight.mul_(3)
            elif how == "replaced":
                model.emb.weight = nn.Parameter(torch.randn(11, 6), requires_grad=False)
            else:
                model.scale = torch.full((6,), 2.0)

    _assert_compiled_tracks_eager(batchrules.clipped_grad(loss, 0.5), _trained(model), change)


class Tied(nn.Module):
    """GPT-2's tie: the embedding's weight is the output projection's."""

    def __init__(self, frozen: bool) -> None:
        super().__init__()
        self.emb, self.mid, self.out = nn.Embedding(11, 6), nn.Linear(6, 6), nn.Linear(6, 11, bias=False)
        self.out.weight = self.emb.weight
        self.emb.requires_grad_(not frozen)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.mid(self.emb(x)).mean(1))


@pytest.mark.parametrize("frozen", [True, False])
def test_a_tied_weight(frozen: bool) -> None:
    """Frozen (in the lifted state under both names) or trained (the loss's
    argument under one name): the tie holds in the compiled step."""
    torch.manual_seed(0)
    model = Tied(frozen)

    def loss(p: Dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return F.cross_entropy(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    def change() -> None:
        with torch.no_grad():
            (model.emb if frozen else model.mid).weight.mul_(3)

    _assert_compiled_tracks_eager(batchrules.clipped_grad(loss, 0.5), _trained(model), change)


def test_a_dict_and_a_tensor_in_the_closure() -> None:
    """The bench's way: the frozen tensors as a dict the loss closes over, and
    a tensor of its own; rebinding the closure's variable is seen."""
    torch.manual_seed(0)
    model = Frozen()
    fixed = {k: v.detach() for k, v in model.named_parameters() if not v.requires_grad}
    mix = torch.randn(3, 3)

    def loss(p: Dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        out = functional_call(model, (p, fixed), (xi.unsqueeze(0),)) @ mix
        return F.cross_entropy(out, yi.unsqueeze(0))

    def change() -> None:
        nonlocal mix
        mix = torch.randn(3, 3)

    _assert_compiled_tracks_eager(batchrules.clipped_grad(loss, 0.5), _trained(model), change)


def test_a_recurrent_module_dynamo_does_not_wrap() -> None:
    """Dynamo refuses to wrap a GRU: its parameters are read from their dicts."""
    torch.manual_seed(0)
    model = Frozen(rnn=True).double()
    loss = functools.partial(_global_loss, model)

    def change() -> None:
        with torch.no_grad():
            model.body.weight_hh_l0.mul_(3)

    _assert_compiled_tracks_eager(batchrules.clipped_grad(loss, 0.5), _trained(model), change,
                                  backend="aot_eager")


def _global_loss(model: nn.Module, p: Dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
    return F.cross_entropy(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))


GLOBAL_MODEL = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))


def test_closed_over_finds_what_the_loss_reaches() -> None:
    inner, other = nn.Linear(2, 2), nn.Linear(3, 3)
    held = {"w": torch.ones(2), "n": 3}
    not_tensors = {"n": 3}

    class Holder:
        def __init__(self, module: nn.Module) -> None:
            self.module = module

        def loss(self, p: Any) -> Any:
            return self.module(p)

    def helper(x: Tensor) -> Tensor:
        return inner(x) * held["w"]

    def loss(p: Any) -> Any:
        return GLOBAL_MODEL(helper(p)) + not_tensors["n"] + GLOBAL_MODEL[0](p) * held["w"]

    modules, cells = closed_over(loss)
    assert modules == (GLOBAL_MODEL, inner) or modules == (inner, GLOBAL_MODEL)
    assert [c.cell_contents for c in cells] == [held]  # once: loss and helper share the cell
    assert closed_over(functools.partial(_global_loss, other))[0] == (other,)
    assert closed_over(Holder(other).loss)[0] == (other,)
    assert closed_over(F.cross_entropy) == ((), ())


def test_a_tensor_held_elsewhere_is_a_constant_and_warned_of() -> None:
    """A tensor neither passed nor closed over (an object's attribute) stays a
    constant of the graph: aot_eager runs it, and the user is told."""
    torch.manual_seed(0)
    model = Frozen()
    holder = types.SimpleNamespace(mix=torch.randn(3, 3))

    def loss(p: Dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        out = functional_call(model, p, (xi.unsqueeze(0),)) @ holder.mix
        return F.cross_entropy(out, yi.unsqueeze(0))

    clipped = batchrules.clipped_grad(loss, 0.5)
    x, y = _batch()
    with pytest.warns(UserWarning, match=r"reads a tensor it is not given \(shape \(3, 3\)"):
        got = torch.compile(clipped, fullgraph=True, backend="aot_eager")(_trained(model), x, y)
    assert_close_rel(got, clipped(_trained(model), x, y))
