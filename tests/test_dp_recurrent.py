"""clipped_grad on recurrent models (dp/layers/recurrent.py): LSTM, GRU, RNN
layers and cells, exact against the per-sample loop in float64, with every
weight clipped from its rows and gate gradients (kind "linear": no
per-sample copy), and the cases that take the generic path or are refused."""
from typing import Dict, List, Set

import pytest
import torch
from dp_reference import assert_close_rel, check_model, data, loop_clipped_grad
from torch import Tensor, nn
from torch.func import functional_call

import batchrules
from batchrules.dp import clipping


class LastStep(nn.Module):
    """A recurrent layer, then a linear head on the last step's output."""

    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn
        width = rnn.hidden_size * (2 if rnn.bidirectional else 1)
        self.head = nn.Linear(getattr(rnn, "proj_size", 0) or width, 3)

    def forward(self, x: Tensor) -> Tensor:
        out = self.rnn(x)[0]
        return self.head(out[:, -1] if self.rnn.batch_first else out[-1])


class Unrolled(nn.Module):
    """A cell stepped over the sequence, then a linear head."""

    def __init__(self, cell: nn.Module) -> None:
        super().__init__()
        self.cell = cell
        self.head = nn.Linear(cell.hidden_size, 3)

    def forward(self, x: Tensor) -> Tensor:
        state = None
        for t in range(x.shape[1]):
            state = self.cell(x[:, t], state)
        return self.head(state[0] if isinstance(state, tuple) else state)


class Transpose(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.transpose(0, 1)


LAYERS = {
    "lstm": lambda: nn.LSTM(3, 4, batch_first=True),
    "gru": lambda: nn.GRU(3, 4, batch_first=True),
    "rnn_tanh": lambda: nn.RNN(3, 4, batch_first=True),
    "rnn_relu": lambda: nn.RNN(3, 4, batch_first=True, nonlinearity="relu"),
    "lstm_2_layers_bidirectional": lambda: nn.LSTM(3, 4, num_layers=2, bidirectional=True,
                                                   batch_first=True),
    "gru_time_major_no_bias": lambda: nn.GRU(3, 4, num_layers=2, bias=False),
}


@pytest.fixture
def joint(monkeypatch) -> List[Set[str]]:
    """The groups of weights whose norms the last clipped_grad call formed
    jointly (Note [Weights sharing an output gradient] in dp/clipping.py)."""
    seen: List[Set[str]] = []
    original = clipping._joint_groups

    def record(params, kinds, fused):
        groups = original(params, kinds, fused)
        seen.clear()
        for group in {id(g): g for g in groups.values()}.values():
            seen.append({p.name[p.name.index("['") + 2:p.name.rindex("']")]
                         for u in group for p, role in u.roles().items() if role == "weight"})
        return groups

    monkeypatch.setattr(clipping, "_joint_groups", record)
    return seen


def only_rules(kinds: Dict[str, str]) -> None:
    assert kinds and all(k in ("linear", "bias") for k in kinds.values()), kinds


@pytest.mark.parametrize("name", list(LAYERS))
def test_layers(routing, kinds, name: str) -> None:
    rnn = LAYERS[name]()
    model = LastStep(rnn) if rnn.batch_first else nn.Sequential(Transpose(), LastStep(rnn))
    check_model(model, *data(5, 3))
    only_rules(kinds)


def test_lstm_and_rnn_weights_share_one_ghost_norm(joint) -> None:
    # W_ih and W_hh of a layer and direction multiply the same gate gradient.
    check_model(LastStep(LAYERS["lstm_2_layers_bidirectional"]()), *data(5, 3))
    assert sorted(map(sorted, joint)) == sorted(
        [[f"rnn.weight_hh_l{k}{d}", f"rnn.weight_ih_l{k}{d}"] for k in (0, 1)
         for d in ("", "_reverse")])
    check_model(LastStep(LAYERS["rnn_relu"]()), *data(5, 3))
    assert joint == [{"rnn.weight_ih_l0", "rnn.weight_hh_l0"}]
    check_model(Unrolled(nn.LSTMCell(3, 4, bias=False)), *data(1, 3))
    assert joint == [{"cell.weight_ih", "cell.weight_hh"}]


def test_gru_and_twice_used_layers_keep_their_own_norms(joint) -> None:
    # A GRU's W_hh gradient has the reset gate in its n part; an LSTM applied twice
    # has two uses of each weight, so its norms are the linears' over both calls.
    check_model(LastStep(LAYERS["gru"]()), *data(5, 3))
    assert joint == []

    class Twice(LastStep):
        def forward(self, x: Tensor) -> Tensor:
            return super().forward(x) + super().forward(x.flip(1))

    check_model(Twice(nn.LSTM(3, 4, batch_first=True)), *data(5, 3))
    assert joint == []


@pytest.mark.parametrize("cell", [nn.LSTMCell, nn.GRUCell, nn.RNNCell])
def test_cells(routing, kinds, cell) -> None:
    check_model(Unrolled(cell(3, 4)), *data(4, 3))
    only_rules(kinds)


@pytest.mark.parametrize("name", [*LAYERS, "lstm_cell", "gru_cell"])
def test_empty_batch(routing, name: str) -> None:
    """A Poisson-sampled batch may be empty: eager runs it, and so does
    clipped_grad. With has_aux the loss runs (Note [An empty batch] in
    dp/transform.py), so the rules see a layer over B = 0 samples."""
    if name.endswith("_cell"):
        model = Unrolled((nn.LSTMCell if name == "lstm_cell" else nn.GRUCell)(3, 4)).double()
    else:
        rnn = LAYERS[name]()
        model = (LastStep(rnn) if rnn.batch_first else nn.Sequential(Transpose(), LastStep(rnn))).double()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = torch.randn(0, 5, 3, dtype=torch.float64), torch.zeros(0, dtype=torch.int64)
    assert model(x).shape == (0, 3)  # eager

    def loss(p, xi, yi):
        logits = functional_call(model, p, (xi[None],))
        return nn.functional.cross_entropy(logits, yi[None]), logits

    (sums, norms), logits = batchrules.clipped_grad(loss, 0.5, has_aux=True)(params, x, y)
    assert norms.shape == (0,) and logits.shape == (0, 1, 3) and sums.keys() == params.keys()
    for k, s in sums.items():
        assert s.shape == params[k].shape and not s.any(), k


def test_projection_takes_the_generic_path(kinds) -> None:
    # proj_size: W_hr's gradient needs the projected states' gradients, which the
    # recurrence does not expose; every weight of the layer is then a per-sample copy.
    check_model(LastStep(nn.LSTM(3, 4, proj_size=2, batch_first=True)), *data(5, 3))
    assert kinds["rnn.weight_hr_l0"] == "materialized"
    assert kinds["head.weight"] == "linear"


def test_frozen_input_weights(kinds) -> None:
    model = LastStep(nn.GRU(3, 4, batch_first=True)).double()
    params = {k: v.detach() for k, v in model.named_parameters() if k != "rnn.weight_ih_l0"}
    x, y = data(5, 3)

    def loss(p, xi, yi):
        return nn.functional.cross_entropy(functional_call(model, p, (xi[None],), strict=False),
                                           yi[None])

    assert_close_rel(batchrules.clipped_grad(loss, 0.5)(params, x, y),
                     loop_clipped_grad(loss, 0.5, (params, x, y)))


def test_packed_sequences_are_refused() -> None:
    model = nn.LSTM(3, 4).double()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi):
        # One sequence of T steps, packed as nn.utils.rnn would (pack_padded_sequence
        # itself calls .item(), which no vmap can run).
        packed = nn.utils.rnn.PackedSequence(xi, torch.ones(xi.shape[0], dtype=torch.int64))
        return functional_call(model, p, (packed,))[0].data.sum()

    with pytest.raises(RuntimeError, match=r"clipped_grad: torch.lstm on a PackedSequence"):
        batchrules.clipped_grad(loss, 1.0)(params, torch.randn(5, 6, 3, dtype=torch.float64))
