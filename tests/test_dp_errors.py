"""Bad input to clipped_grad: a clear error naming the problem, never a wrong norm."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, vmap

import batchrules


def params():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 4, generator=g), "b": torch.randn(3, generator=g)}


def loss(p, x, y):
    return F.cross_entropy(F.linear(x, p["w"], p["b"]), y)


X, Y = torch.randn(5, 4), torch.randint(3, (5,))


@pytest.mark.parametrize("max_norm", [0, -1.0, math.inf, math.nan, True, "1", None])
def test_max_norm(max_norm) -> None:
    with pytest.raises(ValueError, match="max_norm must be a finite number > 0"):
        batchrules.clipped_grad(loss, max_norm)


@pytest.mark.parametrize("argnums,error", [("0", TypeError), ((), TypeError), (1.5, TypeError),
                                           ((0, 0), ValueError), (True, TypeError)])
def test_argnums_type(argnums, error) -> None:
    with pytest.raises(error, match="argnums"):
        batchrules.clipped_grad(loss, 1.0, argnums=argnums)


def test_argnums_out_of_range() -> None:
    with pytest.raises(ValueError, match="argnums 3 out of range for 3"):
        batchrules.clipped_grad(loss, 1.0, argnums=3)(params(), X, Y)


@pytest.mark.parametrize("in_dims", [0, (0, 0, 0), ({"w": None, "b": 0}, 0, 0)])
def test_batched_differentiated_argument(in_dims) -> None:
    with pytest.raises(ValueError, match="argument 0 is differentiated .* must be unbatched"):
        batchrules.clipped_grad(loss, 1.0, in_dims=in_dims)(params(), X, Y)


def test_in_dims_length() -> None:
    with pytest.raises(ValueError, match="one entry per positional argument \\(3\\)"):
        batchrules.clipped_grad(loss, 1.0, in_dims=(None, 0))(params(), X, Y)


def test_batch_sizes_disagree() -> None:
    with pytest.raises(ValueError, match=r"same size in the mapped dimension, got sizes \[5, 4\]"):
        batchrules.clipped_grad(loss, 1.0)(params(), X, Y[:4])


def test_loss_not_a_scalar_per_sample() -> None:
    def per_class(p, x, y):
        return F.linear(x, p["w"], p["b"])

    with pytest.raises(ValueError, match=r"scalar per sample; got shape \(3,\)"):
        batchrules.clipped_grad(per_class, 1.0)(params(), X, Y)
    with pytest.raises(ValueError, match="dtype torch.int64"):
        batchrules.clipped_grad(lambda p, x, y: y, 1.0)(params(), X, Y)
    with pytest.raises(TypeError, match="must return a tensor, got float"):
        batchrules.clipped_grad(lambda p, x, y: 1.0, 1.0)(params(), X, Y)


def test_has_aux_needs_a_pair() -> None:
    with pytest.raises(ValueError, match=r"\(loss, aux\) pair"):
        batchrules.clipped_grad(loss, 1.0, has_aux=True)(params(), X, Y)


@pytest.mark.parametrize("bad,error,match", [
    (torch.ones(3, dtype=torch.int64), TypeError, r"argument 0\['b'\] has dtype torch.int64"),
    (1.0, TypeError, r"argument 0\['b'\] is a float"),
    (nn.Parameter(torch.randn(3), requires_grad=False), ValueError,
     r"argument 0\['b'\] is an nn.Parameter with requires_grad=False"),
])
def test_params_that_cannot_be_differentiated(bad, error, match) -> None:
    with pytest.raises(error, match=match):
        batchrules.clipped_grad(loss, 1.0)({**params(), "b": bad}, X, Y)


def test_escaped_use_is_reported() -> None:
    """A parameter passed into a nested transform is wrapped there, out of
    reach of the interception: reported, not a wrong norm."""
    def inner_step(p, x, y):
        def inner(w):
            return F.cross_entropy(F.linear(x, w, p["b"]), y)
        return inner(p["w"] - 0.1 * grad(inner)(p["w"]))

    with pytest.raises(RuntimeError, match=r"argument 0\['w'\], argument 0\['b'\] reached the loss"):
        batchrules.clipped_grad(inner_step, 1.0)(params(), X, Y)


def test_recorded_input_modified_in_place() -> None:
    def mutating(p, x, y):
        h = x * 2
        out = F.linear(h, p["w"], p["b"])
        h.add_(1)
        return F.cross_entropy(out + h.sum(), y)

    with pytest.raises(RuntimeError, match=r"input of the linear of argument 0\['w'\] was modified"):
        batchrules.clipped_grad(mutating, 1.0)(params(), X, Y)


@pytest.mark.parametrize("kwargs,match", [({"max_norm": 1.0}, "max_norm=1.0"),
                                          ({"sparse": True}, "sparse=True")])
def test_embedding_options(kwargs, match) -> None:
    table = {"e": torch.randn(6, 3)}

    def emb_loss(p, idx, y):
        return F.cross_entropy(F.embedding(idx, p["e"], **kwargs).sum(0), y)

    with pytest.raises(ValueError, match=match):
        batchrules.clipped_grad(emb_loss, 1.0)(table, torch.randint(6, (5, 2)), Y)


def test_inside_a_transform() -> None:
    step, p = batchrules.clipped_grad(loss, 1.0), params()
    with pytest.raises(RuntimeError, match="cannot run inside a torch.func transform"):
        vmap(lambda x: step(p, x, Y)[1])(X.unsqueeze(0))


def test_shape_errors_name_per_sample_shapes() -> None:
    with pytest.raises(RuntimeError, match=r"per-sample shape \(1, 5\) has 5 features, expected 4"):
        batchrules.clipped_grad(loss, 1.0)(params(), torch.randn(5, 1, 5), Y.unsqueeze(1))
    conv = {"w": torch.randn(2, 3, 3, 3)}

    def conv_loss(p, x):
        return F.conv2d(x, p["w"]).sum()

    with pytest.raises(RuntimeError, match=r"expects 3 input channels; the input's per-sample "
                                           r"shape \(1, 4, 5, 5\) has 4"):
        batchrules.clipped_grad(conv_loss, 1.0)(conv, torch.randn(5, 1, 4, 5, 5))
