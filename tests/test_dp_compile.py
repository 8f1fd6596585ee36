"""clipped_grad inside torch.compile(fullgraph=True): the compiled step equals
the eager one and the per-sample loop, with no graph break, and Poisson-sized
batches do not compile once per size (Note [clipped_grad under torch.compile])."""
from typing import Any, Callable, Dict, Tuple

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from conftest import root_cause
from dp_reference import assert_close_rel, loop_clipped_grad
from torch import Tensor, nn
from torch.func import functional_call

import batchrules

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Tokens(nn.Module):
    """Embedding, a recurrent layer, a head on the last step."""

    def __init__(self, rnn: Callable[..., nn.Module]) -> None:
        super().__init__()
        self.emb, self.rnn, self.head = nn.Embedding(11, 6), rnn(6, 5, batch_first=True), nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.rnn(self.emb(x))[0][:, -1])


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.layer(x).mean(1))


def _inputs(*shape: int) -> Callable[[int], Tensor]:
    return lambda batch: torch.randn(batch, *shape)


def _tokens(steps: int) -> Callable[[int], Tensor]:
    return lambda batch: torch.randint(11, (batch, steps))


# name: (model, per-batch inputs); every rule family of the DP tests
FAMILIES: Dict[str, Tuple[Callable[[], nn.Module], Callable[[int], Tensor]]] = {
    "mlp": (lambda: nn.Sequential(nn.Linear(6, 7), nn.SiLU(), nn.Linear(7, 3)), _inputs(6)),
    "sequence_linear_layer_norm": (lambda: nn.Sequential(
        nn.Linear(6, 7), nn.LayerNorm(7), nn.Tanh(), nn.Flatten(), nn.Linear(28, 3)), _inputs(4, 6)),
    "conv_group_norm": (lambda: nn.Sequential(
        nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2),
        nn.Flatten(), nn.Linear(16, 3)), _inputs(2, 8, 8)),
    "conv1d": (lambda: nn.Sequential(nn.Conv1d(2, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(16, 3)),
               _inputs(2, 6)),
    "encoder": (Encoder, _inputs(5, 8)),
    "embedding_lstm": (lambda: Tokens(nn.LSTM), _tokens(4)),
    "embedding_gru": (lambda: Tokens(nn.GRU), _tokens(4)),
}


def _loss(model: nn.Module) -> Callable[..., Tensor]:
    def loss(p: Dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return F.cross_entropy(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))
    return loss


Family = Tuple[nn.Module, Dict[str, Tensor], Callable[[int], Tensor]]


def _family(name: str, dtype: torch.dtype = torch.float64) -> Family:
    torch.manual_seed(0)
    build, inputs = FAMILIES[name]
    model = build().to(dtype)

    def make(batch: int) -> Tensor:
        x = inputs(batch)
        return x.to(dtype) if x.is_floating_point() else x
    return model, {k: v.detach() for k, v in model.named_parameters()}, make


def _step(clipped: Callable[..., Any]) -> Callable[..., Any]:
    """A DP-SGD step as a user writes it: clipped sums, noise, update."""
    def step(p: Dict[str, Tensor], x: Tensor, y: Tensor, noise: Dict[str, Tensor]) -> Any:
        sums, norms = clipped(p, x, y)
        return {k: v - 0.1 * (sums[k] + noise[k]) / x.shape[0] for k, v in p.items()}, sums, norms
    return step


@pytest.mark.parametrize("name", list(FAMILIES))
def test_compiled_step_equals_the_loop(name: str) -> None:
    """float64 through AOTAutograd (the graph Inductor receives), fullgraph."""
    model, params, inputs = _family(name)
    loss = _loss(model)
    step = _step(batchrules.clipped_grad(loss, 0.5))
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x, y = inputs(5), torch.randint(3, (5,))
    noise = {k: torch.randn_like(v) for k, v in params.items()}
    params_out, sums, norms = compiled(params, x, y, noise)
    want_sums, want_norms = loop_clipped_grad(loss, 0.5, (params, x, y))
    assert_close_rel((sums, norms), (want_sums, want_norms))
    assert (want_norms > 0.5).any(), "the test must clip some samples"
    assert_close_rel(params_out, step(params, x, y, noise)[0])


@pytest.mark.parametrize("name", ["mlp", "encoder", "embedding_lstm"])
def test_inductor_equals_eager(name: str) -> None:
    """float32 with Inductor: the compiled step's sums, norms and update."""
    model, params, inputs = _family(name, torch.float32)
    step = _step(batchrules.clipped_grad(_loss(model), 0.5))
    x, y = inputs(6), torch.randint(3, (6,))
    noise = {k: torch.randn_like(v) for k, v in params.items()}
    got = torch.compile(step, fullgraph=True)(params, x, y, noise)
    want = step(params, x, y, noise)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_one_graph_no_break() -> None:
    model, params, inputs = _family("encoder")
    step = _step(batchrules.clipped_grad(_loss(model), 0.5))
    x, y = inputs(4), torch.randint(3, (4,))
    noise = {k: torch.zeros_like(v) for k, v in params.items()}
    explained = torch._dynamo.explain(step)(params, x, y, noise)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_batch_sizes_share_one_dynamic_graph(name: str) -> None:
    """Poisson sampling varies the batch: a static graph for the first size,
    one dynamic graph for every later size, each equal to eager."""
    model, params, inputs = _family(name)
    clipped = batchrules.clipped_grad(_loss(model), 0.5)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda p, x, y: clipped(p, x, y), fullgraph=True, backend=counter)
    for batch in (4, 5, 7, 3, 9):
        x, y = inputs(batch), torch.randint(3, (batch,))
        assert_close_rel(compiled(params, x, y), clipped(params, x, y))
    assert counter.frame_count == 2


def test_aux_tuple_argnums_and_in_dims() -> None:
    """The compiled call takes and returns what the eager one does."""
    model, params, inputs = _family("mlp")
    weights = {k: v for k, v in params.items() if k.endswith("weight")}
    biases = {k: v for k, v in params.items() if k.endswith("bias")}

    def loss(w: Dict[str, Tensor], b: Dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tuple[Tensor, Tensor]:
        out = functional_call(model, {**w, **b}, (xi.unsqueeze(0),))
        return F.cross_entropy(out, yi.unsqueeze(0)), out.argmax()

    clipped = batchrules.clipped_grad(loss, 0.5, argnums=(0, 1), has_aux=True, in_dims=(None, None, 1, 0))
    x, y = inputs(5).t().contiguous(), torch.randint(3, (5,))
    got = torch.compile(clipped, fullgraph=True, backend="aot_eager")(weights, biases, x, y)
    assert_close_rel(got, clipped(weights, biases, x, y))


def test_user_errors_raise_when_compiled() -> None:
    """A loss that is not a scalar per sample: clipped_grad's ValueError is the
    root of the exception Dynamo raises (its traceback shows it)."""
    model, params, inputs = _family("mlp")

    def loss(p: Dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return functional_call(model, p, (xi,))

    clipped = batchrules.clipped_grad(loss, 0.5)
    with pytest.raises(Exception) as raised:
        torch.compile(clipped, fullgraph=True, backend="aot_eager")(params, inputs(5), torch.zeros(5))
    root = root_cause(raised.value)
    assert isinstance(root, ValueError) and "scalar per sample" in str(root)


def test_created_inside_the_compiled_function_is_refused() -> None:
    model, params, inputs = _family("mlp")

    def step(p: Dict[str, Tensor], x: Tensor, y: Tensor) -> Any:
        return batchrules.clipped_grad(_loss(model), 0.5)(p, x, y)

    with pytest.raises(Exception, match="cannot be created inside a compiled function"):
        torch.compile(step, fullgraph=True, backend="aot_eager")(params, inputs(5), torch.randint(3, (5,)))
