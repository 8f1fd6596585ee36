"""The engine's noise: ``gaussian_noise``'s distribution, generator and devices,
secure mode drawing from ``os.urandom`` only, and the engine's update minus its
noise-free value having std sigma * C / B (float64)."""
import math
import os
from typing import Callable, Dict, List

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from batchrules.dp import PrivacyEngine
from batchrules.dp.engine.noise import gaussian_noise, secure_uniform


def ks_distance(samples: torch.Tensor) -> float:
    """Kolmogorov-Smirnov distance of ``samples`` from N(0, 1)."""
    x = samples.flatten().double().sort().values
    cdf = torch.special.ndtr(x)
    n = x.numel()
    above = torch.arange(1, n + 1, dtype=torch.float64) / n - cdf
    below = cdf - torch.arange(n, dtype=torch.float64) / n
    return max(above.max().item(), below.max().item())


@pytest.mark.parametrize("secure", [False, True])
def test_noise_is_gaussian_with_std(secure: bool) -> None:
    """Kolmogorov-Smirnov against N(0, std^2), at level 1e-4: a false alarm
    is negligible, and a std wrong by 5% fails whatever the draw (its
    expected distance, 0.0115, is twice the critical one; at 2% it would be
    below it, and the secure mode's unseeded draws then fail at random)."""
    torch.manual_seed(0)
    like = torch.zeros(400, 500, dtype=torch.float64)
    noise = gaussian_noise(like, 0.7, None, secure)
    assert noise.shape == like.shape and noise.dtype == like.dtype
    critical = math.sqrt(-math.log(1e-4 / 2) / (2 * like.numel()))
    assert ks_distance(noise / 0.7) < critical
    assert ks_distance(noise / 0.7 / 1.05) > critical


def test_generator_fixes_the_noise() -> None:
    like = torch.zeros(3, 4, dtype=torch.float32)
    a = gaussian_noise(like, 1.0, torch.Generator().manual_seed(5))
    b = gaussian_noise(like, 1.0, torch.Generator().manual_seed(5))
    assert a.dtype == torch.float32 and torch.equal(a, b)
    assert not torch.equal(a, gaussian_noise(like, 1.0, torch.Generator().manual_seed(6)))
    assert torch.equal(gaussian_noise(like, 0.0, None), torch.zeros_like(like))


def test_secure_refuses_a_generator() -> None:
    with pytest.raises(ValueError, match="generator=None"):
        gaussian_noise(torch.zeros(2), 1.0, torch.Generator(), secure=True)


def urandom_only(monkeypatch: pytest.MonkeyPatch) -> List[int]:
    """From now on: os.urandom counted (the sizes asked for, returned) and
    torch's generators forbidden."""
    calls: List[int] = []
    real_urandom = os.urandom

    def counting_urandom(n: int) -> bytes:
        calls.append(n)
        return real_urandom(n)

    def no_torch_rng(*args: object, **kwargs: object) -> None:
        raise AssertionError("secure noise called torch's generator")

    monkeypatch.setattr(os, "urandom", counting_urandom)
    for name in ("normal", "randn", "rand", "randn_like"):
        monkeypatch.setattr(torch, name, no_torch_rng)
    monkeypatch.setattr(torch.Tensor, "normal_", no_torch_rng)
    return calls


def test_secure_noise_draws_from_urandom_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """32 bytes of os.urandom per element (4 normals, Box-Muller from 53-bit
    uniforms); torch's generators are neither read nor advanced."""
    calls = urandom_only(monkeypatch)
    state = torch.get_rng_state()
    noise = gaussian_noise(torch.zeros(5, 7, dtype=torch.bfloat16), 2.0, None, secure=True)
    assert noise.dtype == torch.bfloat16 and noise.shape == (5, 7)
    assert sum(calls) == 32 * 35 and torch.equal(torch.get_rng_state(), state)


def test_secure_noise_follows_urandom(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same os.urandom bytes give the same noise: urandom is its only source."""
    monkeypatch.setattr(os, "urandom", lambda n: bytes((7 * i + 3) % 256 for i in range(n)))
    like = torch.zeros(11, dtype=torch.float64)
    torch.manual_seed(0)
    a = gaussian_noise(like, 1.0, None, secure=True)
    torch.manual_seed(1)
    assert torch.equal(a, gaussian_noise(like, 1.0, None, secure=True))


def test_secure_uniform_range() -> None:
    u = secure_uniform(100_000)
    assert u.dtype == torch.float64 and 0 <= u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 5 * (1 / 12 / 100_000) ** 0.5
    assert torch.equal(u * 2 ** 53, (u * 2 ** 53).round())  # multiples of 2^-53
    assert secure_uniform(0).shape == (0,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpu_generator_serves_a_cuda_tensor() -> None:
    like = torch.zeros(4, device="cuda")
    noise = gaussian_noise(like, 1.0, torch.Generator().manual_seed(0))
    assert noise.device == like.device
    assert torch.equal(noise.cpu(), gaussian_noise(like.cpu(), 1.0, torch.Generator().manual_seed(0)))


def engine_step(sigma: float, loss_reduction: str, secure: bool = False, generator_seed: int = 0,
                before_step: Callable[[], None] = lambda: None) -> Dict[str, torch.Tensor]:
    """One ``SGD(lr=1)`` step of a private float64 MLP on a fixed batch of B = 16
    (``expected_batch_size`` 16); returns the parameters' update.
    ``before_step()`` runs once the model and data are made."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 96), nn.Tanh(), nn.Linear(96, 64)).double()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    data = TensorDataset(torch.randn(64, 32, dtype=torch.float64), torch.randint(0, 64, (64,)))
    engine = PrivacyEngine(accountant="rdp", secure_mode=secure)
    private, optimizer, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(data, batch_size=16), noise_multiplier=sigma, max_grad_norm=0.7,
        poisson_sampling=False, loss_reduction=loss_reduction,
        noise_generator=None if secure else torch.Generator().manual_seed(generator_seed))
    x, y = data[:16]
    before_step()
    optimizer.zero_grad()
    F.cross_entropy(private(x), y, reduction=loss_reduction).backward()
    optimizer.step()
    return {k: v - start[k] for k, v in model.state_dict().items()}


def variance_ok(samples: torch.Tensor) -> bool:
    """The mean square of ``samples`` is 1 within 5 standard deviations (2/n)^0.5."""
    return abs(samples.pow(2).mean().item() - 1) < 5 * math.sqrt(2 / samples.numel())


@pytest.mark.requires("opacus")
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_update_noise_has_std_sigma_c_over_b(loss_reduction: str) -> None:
    """The update minus its noise-free value is -noise / B ("mean") or -noise
    ("sum"), noise ~ N(0, (sigma C)^2) per element: its mean square within 5
    standard deviations of std^2 (a std off by 10% fails) and KS at level 1e-4."""
    sigma, clip, batch = 1.3, 0.7, 16
    std = sigma * clip / (batch if loss_reduction == "mean" else 1)
    noisy, clean = engine_step(sigma, loss_reduction), engine_step(0.0, loss_reduction)
    noise = torch.cat([(noisy[k] - clean[k]).flatten() for k in clean])
    assert noise.numel() == 9376
    assert variance_ok(noise / std)
    assert not variance_ok(noise / std / 1.1) and not variance_ok(noise / std * 1.1)
    assert ks_distance(noise / std) < math.sqrt(-math.log(1e-4 / 2) / (2 * noise.numel()))
    assert not torch.equal(engine_step(sigma, loss_reduction, generator_seed=1)["0.weight"],
                           noisy["0.weight"])  # the generator draws the noise


@pytest.mark.requires("opacus")
def test_engine_secure_mode_draws_noise_from_urandom(monkeypatch: pytest.MonkeyPatch) -> None:
    """secure_mode: 32 bytes of os.urandom per trainable element, and no draw
    from torch's generators."""
    calls: List[List[int]] = []  # urandom_only's list, once the step makes it

    def forbid_torch_rng() -> None:
        calls.append(urandom_only(monkeypatch))
        state.append(torch.get_rng_state())

    clean = engine_step(0.0, "mean")
    state: list = []
    noisy = engine_step(1.0, "mean", secure=True, before_step=forbid_torch_rng)
    assert torch.equal(torch.get_rng_state(), state[0])
    assert sum(calls[0]) == 32 * sum(v.numel() for v in clean.values())
    assert not torch.equal(noisy["0.weight"], clean["0.weight"])
