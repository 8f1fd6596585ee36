"""The engine's ``PrivateModule`` inside ``torch.compile(fullgraph=True)``
(Note [The engine under torch.compile]): one graph, Poisson-sized batches
without a compile per size, Inductor equal to eager over several steps with
noise, ``make_private``, autocast, and its errors. The compiled step is
checked exactly against the per-sample loop on every model family, and the
engine's bookkeeping (gradient accumulation, skipped steps, empty batches,
the first-step validation), in test_dp_engine_models.py's ``compiled``
cases."""
import copy
from typing import Any, Callable, List, Optional, Tuple

import pytest
import test_dp_engine_models as models
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from conftest import root_cause
from torch import Tensor, nn

from batchrules.dp.engine import DPOptimizer, PrivateModule

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _engine(model: nn.Module, *, noise: float = 0.0, validate: bool = True,
            momentum: float = 0.0) -> Tuple[PrivateModule, DPOptimizer]:
    private = PrivateModule(model, validate=validate)
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=momentum),
                            module=private, noise_multiplier=noise, max_grad_norm=0.5,
                            expected_batch_size=6, generator=torch.Generator().manual_seed(0))
    return private, optimizer


def _train(forward: Callable[..., Tensor], optimizer: DPOptimizer,
           batches: List[Tuple[Tensor, Tensor]]) -> None:
    for x, y in batches:
        optimizer.zero_grad()
        F.cross_entropy(forward(x), y).backward()
        optimizer.step()


def _batches(sizes: Tuple[int, ...], dtype: torch.dtype = torch.float64) -> List[Tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(b, 5, generator=g, dtype=dtype), torch.randint(0, 3, (b,), generator=g))
            for b in sizes]


def _mlp(dtype: torch.dtype = torch.float64, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Dropout(dropout), nn.LayerNorm(8),
                         nn.Linear(8, 3)).to(dtype)


def test_one_graph_no_break() -> None:
    private, _ = _engine(_mlp())
    x = torch.randn(6, 5, dtype=torch.float64)
    explained = torch._dynamo.explain(private)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)


def test_batch_sizes_share_one_dynamic_graph() -> None:
    """Poisson sampling varies the batch: a graph for the first size (before
    the validation has started), one dynamic graph for every later size;
    every step equal to the eager engine's, dropout masks included (the
    graph draws them as eager does)."""
    sizes = (4, 5, 7, 3, 9, 6)
    eager_model, compiled_model = _mlp(dropout=0.3), _mlp(dropout=0.3)
    eager, eager_optimizer = _engine(eager_model)
    private, optimizer = _engine(compiled_model)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    torch.manual_seed(5)
    _train(torch.compile(private, fullgraph=True, backend=counter), optimizer, _batches(sizes))
    torch.manual_seed(5)
    _train(eager, eager_optimizer, _batches(sizes))
    assert counter.frame_count == 2
    for got, want in zip(compiled_model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("family", ["mlp", "lstm"])
def test_inductor_equals_eager_over_steps_with_noise(family: str) -> None:
    """float32, Inductor, SGD with momentum, noise from the same generator."""
    build: Callable[[], nn.Module] = (lambda: _mlp(torch.float32)) if family == "mlp" else \
        (lambda: models.LSTMClassifier())
    torch.manual_seed(0)
    eager_model = build()
    compiled_model = copy.deepcopy(eager_model)
    if family == "mlp":
        batches = _batches((6, 6, 4), torch.float32)
    else:
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randint(0, models.VOCAB, (b, 7), generator=g),
                    torch.randint(0, 3, (b,), generator=g)) for b in (6, 6, 4)]
    eager, eager_optimizer = _engine(eager_model, noise=0.3, momentum=0.9)
    private, optimizer = _engine(compiled_model, noise=0.3, momentum=0.9)
    _train(torch.compile(private, fullgraph=True), optimizer, batches)
    _train(eager, eager_optimizer, batches)
    for got, want in zip(compiled_model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_make_private_with_poisson_batches() -> None:
    """PrivacyEngine.make_private, then the model compiled, as an Opacus
    user would: Poisson-sampled batches and noise, equal to eager, with the
    same privacy spent."""
    from torch.utils.data import DataLoader, TensorDataset

    from batchrules.dp import PrivacyEngine

    data = TensorDataset(torch.randn(120, 5, dtype=torch.float64), torch.randint(0, 3, (120,)))

    def train(backend: Optional[str]) -> Tuple[List[Tensor], float]:
        model = _mlp()
        engine = PrivacyEngine(accountant="rdp")
        private, optimizer, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=12), noise_multiplier=1.0, max_grad_norm=1.0)
        forward = private if backend is None else torch.compile(private, fullgraph=True,
                                                                backend=backend)
        torch.manual_seed(1)  # the sampling and the noise
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(forward(x), y).backward()
            optimizer.step()
        return [p.detach() for p in model.parameters()], engine.get_epsilon(1e-5)

    (eager, eager_eps), (compiled, compiled_eps) = train(None), train("aot_eager")
    assert compiled_eps == eager_eps
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_autocast_equals_eager() -> None:
    """Under bfloat16 autocast, the compiled steps are eager's (the same
    bf16 ops, norms and sums in float32)."""
    def train(backend: Optional[str]) -> List[Tensor]:
        model = _mlp(torch.float32)
        private, optimizer = _engine(model)
        forward = private if backend is None else torch.compile(private, fullgraph=True,
                                                                backend=backend)
        for x, y in _batches((6, 6, 5), torch.float32):
            optimizer.zero_grad()
            with torch.autocast("cpu", torch.bfloat16):
                out = forward(x)
            assert out.dtype == torch.bfloat16
            F.cross_entropy(out.float(), y).backward()
            optimizer.step()
        return [p.detach() for p in model.parameters()]

    for got, want in zip(train("aot_eager"), train(None)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


class SumsTokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.embed(x).sum(1))


def test_zero_length_sequences_equal_eager() -> None:
    """[B, 0, D] inputs: no token reaches the first layer (zero sums) and the
    head's bias alone is clipped, as eagerly."""
    def train(backend: Optional[str]) -> List[Tensor]:
        torch.manual_seed(0)
        model = SumsTokens().double()
        private, optimizer = _engine(model, validate=False)
        forward = private if backend is None else torch.compile(private, fullgraph=True,
                                                                backend=backend)
        optimizer.zero_grad()
        x, y = torch.zeros(5, 0, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 1, 0])
        F.cross_entropy(forward(x), y).backward()
        optimizer.step()
        return [p.detach() for p in model.parameters()]

    for got, want in zip(train("aot_eager"), train(None)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


class Escapes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(5, 4)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.first.weight * 2)  # "* 2" has no argument of the batch


def test_parameter_escaping_the_batch_is_reported() -> None:
    private, _ = _engine(Escapes().double())
    forward = torch.compile(private, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception) as raised:
        forward(torch.randn(6, 5, dtype=torch.float64)).sum().backward()
    root = root_cause(raised.value)
    assert isinstance(root, RuntimeError) and "first.weight" in str(root) \
        and "cannot be split per sample" in str(root)


def test_trainable_parameters_changed_is_refused() -> None:
    model = _mlp()
    private, _ = _engine(model)
    model[0].weight.requires_grad_(False)  # after the optimizer saw it
    with pytest.raises(Exception) as raised:
        torch.compile(private, fullgraph=True, backend="aot_eager")(torch.randn(6, 5, dtype=torch.float64))
    assert "trainable parameters changed" in str(root_cause(raised.value))


def test_moved_after_the_optimizer_follows() -> None:
    """``.to()`` after the DPOptimizer: the sinks follow the parameters."""
    model = _mlp(torch.float32)
    private, optimizer = _engine(model, noise=0.0)
    private.double()
    eager_model = copy.deepcopy(model)
    eager, eager_optimizer = _engine(eager_model, noise=0.0)
    batches = _batches((6, 6))
    _train(torch.compile(private, fullgraph=True, backend="aot_eager"), optimizer, batches)
    _train(eager, eager_optimizer, batches)
    for got, want in zip(model.parameters(), eager_model.parameters()):
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.requires("transformers")
def test_transformers_cache_dropped_with_a_warning() -> None:
    """GPT-2's key/value cache cannot leave the compiled call: dropped, said
    once; with use_cache=False nothing is said and the logits are eager's."""
    model = models.gpt2()
    private, _ = _engine(model, validate=False)
    _, kwargs, _ = models.lm_batch()
    forward = torch.compile(private, fullgraph=True, backend="aot_eager")
    with pytest.warns(UserWarning, match="drops its DynamicCache.*use_cache=False"):
        out = forward(**kwargs)
    assert out.past_key_values is None
    torch._dynamo.reset()
    with torch.no_grad():
        want = model(**kwargs, use_cache=False).logits
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        got = forward(**kwargs, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_no_grad_and_frozen_models_run_the_plain_model() -> None:
    model = _mlp()
    private, _ = _engine(model)
    x = torch.randn(3, 5, dtype=torch.float64)
    forward = torch.compile(private, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(forward(x), model(x))
    out: Optional[Any] = forward(x)
    assert out is not None and out.requires_grad
