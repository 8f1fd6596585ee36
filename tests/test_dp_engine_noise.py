"""The engine's noise: ``gaussian_noise``'s distribution, generator and devices, and
secure mode drawing from ``os.urandom`` only."""
import math
import os

import pytest
import torch

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
    """Kolmogorov-Smirnov against N(0, std^2) at a fixed seed, at level 1e-4:
    a false alarm is negligible and a std wrong by 2% fails."""
    torch.manual_seed(0)
    like = torch.zeros(400, 500, dtype=torch.float64)
    noise = gaussian_noise(like, 0.7, None, secure)
    assert noise.shape == like.shape and noise.dtype == like.dtype
    critical = math.sqrt(-math.log(1e-4 / 2) / (2 * like.numel()))
    assert ks_distance(noise / 0.7) < critical
    assert ks_distance(noise / 0.7 / 1.02) > critical


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


def test_secure_noise_draws_from_urandom_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """32 bytes of os.urandom per element (4 normals, Box-Muller from 53-bit
    uniforms); torch's generators are neither read nor advanced."""
    calls = []
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
