"""The loss rules under torch.compile: AOTAutograd traces vmap(grad) with routing on, so the
rules run on FakeTensors, with symbolic sizes under dynamic=True (one graph for several
batch and row counts, including the one-row case the rules special-case)."""
from typing import Callable, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import grad, vmap

import batchrules

C = 5
WEIGHT = torch.linspace(0.5, 2.0, C)


def classes(b: int, n: int, *spatial: int) -> Tuple[Tensor, Tensor]:
    return torch.randn(b, n, C, *spatial), torch.randint(0, C, (b, n, *spatial))


def regression(b: int, n: int) -> Tuple[Tensor, Tensor]:
    return torch.randn(b, n, C), torch.randn(b, n, C)


CASES = {
    "cross_entropy": (F.cross_entropy, classes),
    "cross_entropy_weight_ignore": (lambda x, t: F.cross_entropy(x, t, WEIGHT, ignore_index=1),
                                    classes),
    "cross_entropy_spatial": (F.cross_entropy, lambda b, n: classes(b, n, 2, 3)),
    "mse": (F.mse_loss, regression),
    "huber": (F.huber_loss, regression),
}


@pytest.mark.parametrize("case", CASES)
def test_compiled_vmap_grad_dynamic(case: str) -> None:
    torch.manual_seed(0)
    torch._dynamo.reset()
    loss, make = CASES[case]
    step: Callable = vmap(grad(loss))
    with batchrules.enabled(True):
        compiled = torch.compile(step, dynamic=True, fullgraph=True, backend="aot_eager")
        for b, n in [(3, 4), (5, 2), (4, 1)]:
            args = make(b, n)
            with batchrules.enabled(False):
                expected = step(*args)
            torch.testing.assert_close(compiled(*args), expected)


def test_compiled_with_inductor() -> None:
    torch.manual_seed(0)
    torch._dynamo.reset()
    step = vmap(grad(F.cross_entropy))
    x, t = classes(3, 4)
    with batchrules.enabled(True):
        got = torch.compile(step, fullgraph=True, backend="inductor")(x, t)
    with batchrules.enabled(False):
        torch.testing.assert_close(got, step(x, t))
