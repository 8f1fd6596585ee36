"""Logical batches: ``clipped_grad_chunked`` against one ``clipped_grad`` call
(float64), Poisson batch sizes with empty chunks, the example's chunked DP
step, and the peak memory of a 4096-sample step in chunks of 256."""
import dataclasses
import gc

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close, params_of
from torch import nn
from torch.func import functional_call
from torch.profiler import ProfilerActivity, profile

import batchrules
from batchrules.dp import clipped_grad_chunked
from batchrules.examples import dp_sgd


def mlp_loss(model):
    def loss(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi,)), yi)
    return loss


TOL = dict(rtol=1e-10, atol=1e-10)


@pytest.fixture
def mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    x, y = torch.randn(10, 5, dtype=torch.float64), torch.randint(0, 3, (10,))
    return model, x, y


@pytest.mark.parametrize("chunk", [1, 3, 10, 64])
def test_chunks_sum_to_one_call(mlp, chunk: int) -> None:
    model, x, y = mlp
    loss, params = mlp_loss(model), params_of(model)
    want = batchrules.clipped_grad(loss, 0.5)(params, x, y)
    assert_close(clipped_grad_chunked(loss, 0.5, chunk)(params, x, y), want, **TOL)


def test_transformer_chunks() -> None:
    config = dp_sgd.DPConfig(model="transformer", dtype=torch.float64, examples=9)
    model = dp_sgd.make_model(config)
    x, y = dp_sgd.make_data(config)
    loss, params = mlp_loss(model), params_of(model)
    want = batchrules.clipped_grad(loss, 1.0)(params, x, y)
    assert_close(clipped_grad_chunked(loss, 1.0, 4)(params, x, y), want, **TOL)


def test_poisson_sizes_and_empty_chunks(mlp) -> None:
    model, _, _ = mlp
    loss, params = mlp_loss(model), params_of(model)
    g = torch.Generator().manual_seed(0)
    sizes = [int((torch.rand(40, generator=g) < 0.08).sum()) for _ in range(12)]
    assert 0 in sizes and max(sizes) > 3  # empty batches, and batches of several chunks
    for b in sizes:
        x, y = torch.randn(b, 5, dtype=torch.float64), torch.randint(0, 3, (b,))
        got = clipped_grad_chunked(loss, 1.0, 3)(params, x, y)
        assert got[1].shape == (b,)
        assert_close(got, batchrules.clipped_grad(loss, 1.0)(params, x, y), **TOL)
        if b == 0:
            assert all(not s.any() for s in got[0].values())


def test_pytree_in_dims_and_aux(mlp) -> None:
    model, x, y = mlp

    def loss(p, batch):
        out = functional_call(model, p, (batch["x"],))
        return F.cross_entropy(out, batch["y"]), out

    kwargs = dict(in_dims=(None, {"x": 0, "y": 0}), has_aux=True)
    args = (params_of(model), {"x": x, "y": y})
    (got, aux) = clipped_grad_chunked(loss, 1.0, 4, **kwargs)(*args)
    (want, want_aux) = batchrules.clipped_grad(loss, 1.0, **kwargs)(*args)
    assert_close(got, want, **TOL)
    torch.testing.assert_close(aux, want_aux, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunk", [0, -1, 2.0, True])
def test_chunk_size_is_checked(chunk) -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        clipped_grad_chunked(lambda p, x: (p * x).sum(), 1.0, chunk)


def test_example_logical_batch_equals_one_chunk() -> None:
    # q*N = 4.8 over 6 steps: some batches empty, some of several chunks of 2
    config = dp_sgd.DPConfig(steps=6, examples=48, sample_rate=0.1, noise_multiplier=0.7,
                             dtype=torch.float64)
    want, _ = dp_sgd.train(config)
    got, _ = dp_sgd.train(dataclasses.replace(config, physical_batch=2))
    for k, v in want.state_dict().items():
        torch.testing.assert_close(got.state_dict()[k], v, rtol=1e-10, atol=1e-10)


def peak_bytes(fn) -> int:
    """Peak bytes of torch CPU allocations live at once during ``fn()`` beyond
    those live before it (tracemalloc does not see torch's allocator)."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    running = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for e in sorted(events, key=lambda e: e.start_ns()):
        running += e.nbytes()
        peak = max(peak, running)
    return peak


@pytest.mark.slow  # the memory target of logical batches: one chunk's peak, not the batch's
def test_logical_batch_uses_one_chunks_memory() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 512), nn.SiLU(), nn.Linear(512, 512), nn.SiLU(),
                          nn.Linear(512, 10))  # the bench's dp_mlp row
    x, y = torch.randn(4096, 784), torch.randint(0, 10, (4096,))
    loss, params = mlp_loss(model), params_of(model)
    param_bytes = sum(p.numel() * 4 for p in params.values())
    one_chunk = peak_bytes(lambda: batchrules.clipped_grad(loss, 1.0)(params, x[:256], y[:256]))
    logical = peak_bytes(lambda: clipped_grad_chunked(loss, 1.0, 256)(params, x, y))
    # one chunk's working set, plus the running sum it adds into
    assert logical <= one_chunk + 1.1 * param_bytes, (logical, one_chunk, param_bytes)
