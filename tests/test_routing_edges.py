"""Every routed family against the per-example eager loop at the edges: empty
batches, size-1 and empty dims, zero-length sequences, any in_dims, layouts,
dtypes, autocast and nested transforms (the property test of
routing_edges_cases.py), plus the cases that once ended the process.

Each family's property test runs in a child process, so that a crash (a
signal) fails that family's test, naming the example it crashed on, instead of
ending the run (Note [Child processes from a preloaded fork server] in
conftest.py). CI runs EXAMPLES examples a family; ``--thorough`` runs ten
times as many."""
from pathlib import Path

import pytest
import routing_edges_cases
import torch
from conftest import run_in_child
from routing_edges_families import FAMILIES
from torch import nn
from torch.func import grad, jacrev, vmap

import batchrules

EXAMPLES = 30


def run_family(family: str, examples: int, tmp_path: Path) -> None:
    progress = tmp_path / "example.txt"
    code, failure = run_in_child(routing_edges_cases.run, family, examples, str(progress),
                                 timeout=60 + 2 * examples)
    last = progress.read_text() if progress.exists() else "(none drawn)"
    if code < 0:
        pytest.fail(f"{family}: the process died with signal {-code} on {last}")
    assert code == 0, f"{family}:\n{failure[-6000:]}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_routed_equals_eager(family, tmp_path) -> None:
    run_family(family, EXAMPLES, tmp_path)


@pytest.mark.thorough
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_routed_equals_eager_thorough(family, tmp_path) -> None:
    run_family(family, 10 * EXAMPLES, tmp_path)


# ---- the reported cases, each in its own process too -------------------------------

CRASHES = {
    "lstm": "vmap(nn.LSTM(3, 5))(torch.randn(0, 4, 2, 3))",
    "lstm_batch_first": "vmap(nn.LSTM(3, 5, batch_first=True))(torch.randn(0, 2, 4, 3))",
    "lstm_unbatched": "vmap(nn.LSTM(3, 5))(torch.randn(0, 4, 3))",
    "lstm_grad": "vmap(grad(lambda x: lstm(x)[0].sum()))(torch.randn(0, 4, 2, 3))",
    "mha": "vmap(lambda x: m(x[None], x[None], x[None], need_weights=False)[0][0])"
           "(torch.randn(0, 3, 8))",
    "mha_float64": "vmap(lambda x: m.double()(x[None], x[None], x[None], need_weights=False)"
                   "[0][0])(torch.randn(0, 3, 8, dtype=torch.float64))",
}


def empty_batch_shape(name: str, out: str) -> None:
    """CRASHES[name] with routing on, in a child process: its result's shape into ``out``."""
    batchrules.enable()
    scope = {"torch": torch, "nn": nn, "vmap": vmap, "grad": grad,
             "m": nn.MultiheadAttention(8, 2, batch_first=True), "lstm": nn.LSTM(3, 5)}
    result = eval(CRASHES[name], scope)
    result = result[0] if isinstance(result, tuple) else result
    Path(out).write_text(str(tuple(result.shape)))


@pytest.mark.parametrize("name", sorted(CRASHES))
def test_empty_batch_gives_an_empty_result(name, tmp_path) -> None:
    out = tmp_path / "shape.txt"
    code, failure = run_in_child(empty_batch_shape, name, str(out), timeout=120)
    assert code == 0, (code, failure[-3000:])
    assert out.read_text().startswith("(0,"), out.read_text()


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("transform", ["vmap", "grad", "jacrev"])
def test_zero_length_sequence_raises_as_eager(kind, transform, routing_on) -> None:
    module = getattr(nn, kind)(3, 5).double()
    x = torch.randn(0, 2, 3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="Expected sequence length to be larger than 0 in RNN"):
        module(x)
    call = {"vmap": lambda: vmap(module)(x.unsqueeze(0).expand(2, -1, -1, -1)),
            "grad": lambda: grad(lambda t: module(t)[0].sum())(x),
            "jacrev": lambda: jacrev(lambda t: module(t)[0])(x)}[transform]
    with pytest.raises(RuntimeError, match="Expected sequence length to be larger than 0 in RNN"):
        call()


CELL_ERRORS = [  # (cell, input shape, hidden shape, eager's message)
    ("GRUCell", (2, 4), (2, 5), "input has inconsistent input_size: got 4 expected 3"),
    ("GRUCell", (2, 3), (2, 6), "hidden0 has inconsistent hidden_size: got 6, expected 5"),
    ("GRUCell", (2, 3), (3, 5), "Input batch size 2 doesn't match hidden0 batch size 3"),
    ("RNNCell", (2, 4), (2, 5), "input has inconsistent input_size: got 4 expected 3"),
    ("LSTMCell", (2, 4), (2, 5), "input has inconsistent input_size: got 4 expected 3"),
    ("LSTMCell", (2, 3), (2, 6), "hidden0 has inconsistent hidden_size: got 6, expected 5"),
]


@pytest.mark.parametrize("cell, x_shape, h_shape, message", CELL_ERRORS)
def test_cell_errors_are_eagers(cell, x_shape, h_shape, message, routing_on) -> None:
    """Eager's message, with the per-example shapes under vmap."""
    module = getattr(nn, cell)(3, 5).double()

    def call(x, h):
        state = (h, torch.zeros(h.shape[0], 5, dtype=h.dtype)) if cell == "LSTMCell" else h
        out = module(x, state)
        return (out[0] if isinstance(out, tuple) else out).sum()

    x, h = torch.randn(x_shape, dtype=torch.float64), torch.randn(h_shape, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=message):
        call(x, h)
    with pytest.raises(RuntimeError, match=message):
        grad(call)(x, h)
    with pytest.raises(RuntimeError, match=message):
        vmap(call)(x.expand(4, *x_shape), h.expand(4, *h_shape))


def test_cell_mixed_dtypes_raise_eagers_error(routing_on) -> None:
    module = nn.GRUCell(3, 5)
    x, h = torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 5)
    message = "mat1 and mat2 must have the same dtype"
    with pytest.raises(RuntimeError, match=message):
        module(x, h)
    with pytest.raises(RuntimeError, match=message):
        grad(lambda t: module(t, h).sum())(x)
    with pytest.raises(RuntimeError, match=message):
        vmap(lambda t: module(t, h))(x.expand(4, 2, 3))


@pytest.mark.parametrize("case", ["cross_entropy", "nll_loss", "addmm", "mse_loss"])
def test_autocast_dtype_is_the_examples(case, routing_on) -> None:
    w, x = torch.randn(4, 8), torch.randn(5, 3, 8)
    y, bias = torch.randint(0, 4, (5, 3)), torch.randn(4)
    fn = {"cross_entropy": lambda xi, yi: torch.nn.functional.cross_entropy(xi @ w.t(), yi),
          "nll_loss": lambda xi, yi: torch.nn.functional.nll_loss(xi @ w.t(), yi),
          "addmm": lambda xi, yi: torch.addmm(bias, xi, w.t()),
          "mse_loss": lambda xi, yi: torch.nn.functional.mse_loss(
              xi @ w.t(), torch.zeros(3, 4, dtype=torch.bfloat16))}[case]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = torch.stack([fn(xi, yi) for xi, yi in zip(x, y)])
        routed = vmap(fn)(x, y)
    assert routed.dtype == eager.dtype
    torch.testing.assert_close(routed, eager, atol=2e-2, rtol=2e-2)
