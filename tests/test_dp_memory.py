"""What clipped_grad computes: one forward and one backward, no per-sample weight
gradients of ghost-normed layers, and a peak memory near the non-private step's."""
from typing import List

import pytest
import torch
import torch.nn.functional as F
from conftest import run_in_child
from dp_reference import assert_close_rel, loop_clipped_grad
from torch import nn
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode

import batchrules
from batchrules.bench.case import Variant
from batchrules.bench.memory import peak_extra_bytes
from batchrules.bench.models import small_cnn

BATCH = 16
CPU = torch.device("cpu")


class Shapes(TorchDispatchMode):
    """Records the shape of every tensor every op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: List[torch.Size] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(t.shape)
        return out


def run(model: nn.Module, x: torch.Tensor, y: torch.Tensor, monkeypatch) -> List[torch.Size]:
    params = {k: v.detach() for k, v in model.named_parameters()}
    calls = {"loss": 0, "grad": 0, "backward": 0}

    def loss(p, xi, yi):
        calls["loss"] += 1
        return F.cross_entropy(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    real_grad, real_backward = torch.autograd.grad, torch.Tensor.backward

    def counted_grad(*args, **kwargs):
        calls["grad"] += 1
        return real_grad(*args, **kwargs)

    def counted_backward(*args, **kwargs):
        calls["backward"] += 1
        return real_backward(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", counted_grad)
    monkeypatch.setattr(torch.Tensor, "backward", counted_backward)
    with Shapes() as shapes:
        batchrules.clipped_grad(loss, 1.0)(params, x, y)
    assert calls == {"loss": 1, "grad": 1, "backward": 0}, calls
    return shapes.shapes


@pytest.mark.parametrize("routing", [False, True])
def test_mlp_one_pass_no_per_sample_weights(routing: bool, monkeypatch) -> None:
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 10))
    with batchrules.enabled(routing):
        shapes = run(model, torch.randn(BATCH, 64), torch.randint(10, (BATCH,)), monkeypatch)
    # no per-sample weight gradient, nor anything as large
    largest = max(s.numel() for s in shapes)
    assert largest <= 64 * 48, largest
    assert (BATCH, 48, 64) not in shapes and (BATCH, 10, 48) not in shapes


@pytest.mark.parametrize("model_name", ["mlp", "small_cnn"])
def test_peak_memory_near_the_non_private_step(model_name: str) -> None:
    """Allocation peaks (deterministic, not timings): the conv norms run in
    chunks bounded by what the tape holds (Note [Bounded transients]), and
    recorded tensors are released as sums complete, so clipped_grad's peak
    stays within 1.3x of a plain forward + backward's."""
    torch.manual_seed(0)
    if model_name == "mlp":
        model, x = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 10)), torch.randn(64, 64)
    else:
        model, x = small_cnn(), torch.randn(BATCH, 1, 28, 28)
    y = torch.randint(10, (x.shape[0],))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    step = batchrules.clipped_grad(loss, 1.0)
    trainable = list(model.parameters())
    dp = Variant("clipped_grad", lambda: step(params, x, y))
    plain = Variant("nonprivate", lambda: torch.autograd.grad(
        F.cross_entropy(model(x), y, reduction="sum"), trainable))
    for v in (dp, plain):
        v.fn()
    dp_peak, plain_peak = peak_extra_bytes(dp, CPU), peak_extra_bytes(plain, CPU)
    assert dp_peak <= 1.3 * plain_peak, (dp_peak, plain_peak)


class _RmsScale(nn.Module):
    """A hand-written RMSNorm: ``x * rsqrt(mean(x^2)) * weight``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


TOKENS, WIDTH = 8, 32
NORMS = {"group_norm": lambda: nn.GroupNorm(4, TOKENS), "rms_norm": lambda: nn.RMSNorm(WIDTH),
         "rms_scale": lambda: _RmsScale(WIDTH)}


def norm_model(norm: str) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, WIDTH), NORMS[norm](), nn.Linear(WIDTH, WIDTH),
                         nn.Flatten(-2), nn.Linear(TOKENS * WIDTH, 10))


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_norm_scales_take_no_copy_larger_than_the_parameter(norm: str, monkeypatch) -> None:
    """GroupNorm, nn.RMSNorm and a hand-written RMS scale take the generic path: their
    per-sample gradients are [B, C], and no tensor is larger than the largest activation
    (no [B, *weight] of the linears, nor anything [B, T, *scale]-sized per parameter)."""
    model = norm_model(norm)
    x = torch.randn(BATCH, TOKENS, 16)
    shapes = run(model, x, torch.randint(10, (BATCH,)), monkeypatch)
    activation = BATCH * TOKENS * WIDTH
    largest = max(s.numel() for s in shapes)
    assert largest <= activation, (largest, activation)
    scale = model[1].weight
    assert (BATCH, *scale.shape) in shapes  # its per-sample gradient, of its own size


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_norm_scales_are_exact(norm: str) -> None:
    model = norm_model(norm).double()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = torch.randn(BATCH, TOKENS, 16, dtype=torch.float64), torch.randint(10, (BATCH,))

    def loss(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    assert_close_rel(batchrules.clipped_grad(loss, 0.5)(params, x, y),
                     loop_clipped_grad(loss, 0.5, (params, x, y)))


def tensors_left_in_cycles() -> None:
    """Raises if a clipped_grad call leaves a tensor in a reference cycle (run in a
    fresh child: earlier tests' caches drop cycles of their own at any time)."""
    import gc

    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2))
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))

    def loss(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi,)), yi)

    clipped = batchrules.clipped_grad(loss, 1.0)
    clipped(params, x, y)
    gc.collect()
    gc.disable()
    clipped(params, x, y)
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    cyclic = [o for o in gc.garbage if isinstance(o, torch.Tensor)]
    assert cyclic == [], cyclic


def test_no_tensor_outlives_the_call_in_a_reference_cycle() -> None:
    """What clipped_grad held (its leaves are views of the caller's tensors,
    e.g. FSDP's unsharded parameters) is freed when it returns, not at the
    next garbage collection: nothing it leaves in a cycle holds a tensor."""
    code, failure = run_in_child(tensors_left_in_cycles, timeout=120)
    assert code == 0, failure[-3000:]
