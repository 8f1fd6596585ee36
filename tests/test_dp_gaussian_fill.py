"""``batchrules::gaussian_fill_``, the engine's float32 CPU noise: Philox4x32-10
against Random123's known answer and a Python reference of the whole kernel
(float64), both kernels (AVX2, scalar), independence of the thread count,
the statistics of its pairs, adding in place, bad input and opcheck."""
import math
import os
import subprocess
import sys

import pytest
import torch

import batchrules  # noqa: F401  (registers the op)
from batchrules.dp.engine.noise import add_gaussian_noise_, gaussian_noise

OP = torch.ops.batchrules.gaussian_fill_


def fill(x: torch.Tensor, key: int, std: float, accumulate: bool = False) -> torch.Tensor:
    OP(x, key, std, accumulate)
    return x
MUL, WEYL, MASK = (0xD2511F53, 0xCD9E8D57), (0x9E3779B9, 0xBB67AE85), 0xFFFFFFFF


def philox(key: int, block: int) -> list:
    """Philox4x32-10's four words of counter (block's low and high words, 0, 0)."""
    c, k = [block & MASK, block >> 32, 0, 0], [key & MASK, key >> 32]
    for _ in range(10):
        p0, p1 = MUL[0] * c[0], MUL[1] * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k[0]) & MASK, p1 & MASK, ((p0 >> 32) ^ c[3] ^ k[1]) & MASK, p0 & MASK]
        k = [(k[0] + WEYL[0]) & MASK, (k[1] + WEYL[1]) & MASK]
    return c


def reference(key: int, n: int, std: float) -> torch.Tensor:
    """The kernel's normals in float64: Box-Muller on 24-bit uniforms, element
    32 g + 8 j + l output j of block 8 g + l."""
    out = [0.0] * (-(-n // 32) * 32)
    for group in range(len(out) // 32):
        for lane in range(8):
            w = philox(key, 8 * group + lane)
            for pair in range(2):
                r = math.sqrt(-2 * math.log(1 - (w[2 * pair] & 0xFFFFFF) / 2 ** 24))
                theta = 2 * math.pi * (w[2 * pair + 1] & 0xFFFFFF) / 2 ** 24
                out[32 * group + 16 * pair + lane] = r * math.cos(theta) * std
                out[32 * group + 16 * pair + 8 + lane] = r * math.sin(theta) * std
    return torch.tensor(out[:n], dtype=torch.float64)


def test_philox_known_answer() -> None:
    """Random123's kat_vectors: philox4x32 10, counter 0, key 0."""
    assert philox(0, 0) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


CASES = [(0, 1, 1.0), (1, 31, 2.5), (2 ** 63 - 1, 300, 1.0), (-5, 1000, 0.3), (2 ** 40 + 7, 129, 1.0)]


@pytest.mark.parametrize("key,n,std", CASES)
def test_matches_the_reference(key: int, n: int, std: float) -> None:
    got = fill(torch.empty(n), key, std)
    torch.testing.assert_close(got.double(), reference(key % 2 ** 64, n, std), rtol=2e-6, atol=2e-6 * std)


def test_the_scalar_kernel(tmp_path) -> None:
    """The same in a process held to the scalar kernel (BATCHRULES_GAUSSIAN),
    and equal to the AVX2 one within float32 rounding."""
    here = fill(torch.empty(5000), 11, 1.0)
    check = (
        "import torch, test_dp_gaussian_fill as t\n"
        "for key, n, std in t.CASES:\n"
        "    torch.testing.assert_close(t.fill(torch.empty(n), key, std).double(),\n"
        "                               t.reference(key % 2 ** 64, n, std), rtol=2e-6, atol=2e-6 * std)\n"
        "torch.save(t.fill(torch.empty(5000), 11, 1.0), __import__('sys').argv[1])\n")
    path = str(tmp_path / "scalar.pt")
    env = {**os.environ, "BATCHRULES_GAUSSIAN": "scalar",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", check, path], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    torch.testing.assert_close(here, torch.load(path), rtol=2e-6, atol=2e-6)


def test_the_thread_count_does_not_change_it() -> None:
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fill(torch.empty(300_001), 3, 1.0)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(one, fill(torch.empty(300_001), 3, 1.0))
    finally:
        torch.set_num_threads(threads)


def test_moments_and_independence() -> None:
    """Mean 0, std 1, and uncorrelated: neighbours, each pair's cos and sin
    outputs (8 apart) and the two pairs of a block (16 apart), all within 5
    standard errors; keys give unrelated draws."""
    n = 1 << 20
    z = fill(torch.empty(n), 123, 1.0).double()
    bound = 5 / math.sqrt(n)
    assert abs(z.mean().item()) < bound and abs(z.std().item() - 1) < 5 * math.sqrt(2 / n)
    for lag in (1, 8, 16, 32):
        assert abs((z[:-lag] * z[lag:]).mean().item()) < bound, lag
    other = fill(torch.empty(n), 124, 1.0).double()
    assert abs((z * other).mean().item()) < bound
    assert z.abs().max().item() <= math.sqrt(-2 * math.log(2 ** -24)) + 1e-4


@pytest.mark.parametrize("n", [5, 128, 1000])
def test_accumulate_adds_the_same_normals(n: int) -> None:
    x = torch.randn(n)
    assert torch.equal(fill(x.clone(), 9, 0.5, accumulate=True), x + fill(torch.empty(n), 9, 0.5))


@pytest.mark.parametrize("case", ["float32", "float64", "strided", "secure"])
def test_add_gaussian_noise_in_place(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``add_gaussian_noise_`` is ``x.add_(gaussian_noise(x, ...))`` with the
    same draws, on the Philox path and off it."""
    if case == "secure":  # the same urandom bytes for both
        monkeypatch.setattr(os, "urandom", lambda n: bytes(range(256)) * (n // 256) + bytes(n % 256))
    x = torch.randn(6, 50, dtype=torch.float64 if case == "float64" else torch.float32)
    if case == "strided":
        x = x.t()
    generator = None if case == "secure" else torch.Generator().manual_seed(4)
    want = x + gaussian_noise(x, 0.3, generator, case == "secure")
    if generator is not None:
        generator.manual_seed(4)
    got = add_gaussian_noise_(x, 0.3, generator, case == "secure")
    assert got is x and torch.equal(got, want)


def test_zero_and_empty() -> None:
    assert torch.equal(fill(torch.empty(100), 1, 0.0), torch.zeros(100))
    assert fill(torch.empty(0), 1, 1.0).shape == (0,)
    x = torch.empty(3, 0, 5)
    assert fill(x, 1, 1.0) is x


def test_bad_input() -> None:
    with pytest.raises(RuntimeError, match="float32 tensor, but got Double"):
        fill(torch.empty(4, dtype=torch.float64), 1, 1.0)
    with pytest.raises(RuntimeError, match=r"contiguous tensor, but got shape \[4, 3\]"):
        fill(torch.empty(3, 4).t(), 1, 1.0)
    for std in (-1.0, float("nan"), float("inf")):
        with pytest.raises(RuntimeError, match="finite std >= 0"):
            fill(torch.empty(4), 1, std)


def test_opcheck() -> None:
    torch.library.opcheck(OP.default, (torch.empty(2, 40), 7, 1.5))
