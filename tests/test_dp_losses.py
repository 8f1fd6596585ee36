"""The loss under clipped_grad: F.cross_entropy per sample in every shape and
option, against a per-sample loop in float64. No rule intercepts it (it takes
no parameter: Note [Intercepting only the calls that take a parameter]); it
runs under vmap with routing's batching rules for aten's loss kernels."""
import pytest
import torch
import torch.nn.functional as F
from dp_reference import assert_close_rel, loop_clipped_grad

import batchrules

BATCH, CLASSES = 5, 4


def params():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(CLASSES, 3, generator=g, dtype=torch.float64),
            "b": torch.randn(CLASSES, generator=g, dtype=torch.float64)}


# per-sample input shape (without the class dim's position), per-sample target shape
SHAPES = {"one_prediction": ((), ()), "rows": ((2,), (2,)), "spatial": ((2,), (2, 3))}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("options", [{}, {"reduction": "sum"}, {"ignore_index": 1}],
                         ids=["mean", "sum", "ignore_index"])
def test_cross_entropy(shape: str, options) -> None:
    lead, target_shape = SHAPES[shape]
    g = torch.Generator().manual_seed(1)
    spatial = target_shape[1:]
    x = torch.randn(BATCH, *lead, *spatial, 3, generator=g, dtype=torch.float64)
    y = torch.randint(CLASSES, (BATCH, *target_shape), generator=g)
    if options.get("ignore_index") is not None and y.dim() > 1:
        y[:, 0] = 1  # some positions of every sample ignored, never all

    def loss(p, xi, yi):
        logits = F.linear(xi, p["w"], p["b"])  # *, spatial, C
        if spatial:
            logits = logits.movedim(-1, 1)  # N, C, spatial
        return F.cross_entropy(logits, yi, **options)

    if options.get("ignore_index") is not None and y.dim() == 1:
        pytest.skip("a sample of one ignored target has a NaN loss")
    want = loop_clipped_grad(loss, 0.5, (params(), x, y))
    assert_close_rel(batchrules.clipped_grad(loss, 0.5)(params(), x, y), want)


def test_shared_target() -> None:
    x = torch.randn(BATCH, 2, 3, dtype=torch.float64)
    y = torch.tensor([1, 3])

    def loss(p, xi, yi):
        return F.cross_entropy(F.linear(xi, p["w"], p["b"]), yi)

    want = loop_clipped_grad(loss, 0.5, (params(), x, y), in_dims=(None, 0, None))
    assert_close_rel(batchrules.clipped_grad(loss, 0.5, in_dims=(None, 0, None))(params(), x, y), want)


@pytest.mark.parametrize("options", [
    {"weight": torch.tensor([1.0, 2.0, 0.5, 1.0], dtype=torch.float64)},
    {"label_smoothing": 0.1},
    {"probabilities": True},
], ids=["weight", "label_smoothing", "probabilities"])
def test_other_options(options) -> None:
    x = torch.randn(BATCH, 2, 3, dtype=torch.float64)
    y = torch.randint(CLASSES, (BATCH, 2))
    if options.pop("probabilities", False):
        y = torch.softmax(torch.randn(BATCH, 2, CLASSES, dtype=torch.float64), -1)

    def loss(p, xi, yi):
        return F.cross_entropy(F.linear(xi, p["w"], p["b"]), yi, **options)

    want = loop_clipped_grad(loss, 0.5, (params(), x, y))
    assert_close_rel(batchrules.clipped_grad(loss, 0.5)(params(), x, y), want)
