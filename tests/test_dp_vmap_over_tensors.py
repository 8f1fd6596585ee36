"""clipped_grad's own entry into vmap for plain tensor arguments (Note
[clipped_grad's vmap over plain tensors] in batchrules/_compat.py): the same
results, randomness and errors as torch.func.vmap, which every other call
(pytrees, has_aux) still takes."""
import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, vmap

import batchrules
from batchrules import _compat
from batchrules.dp import transform

X, Y = torch.randn(6, 3, 4), torch.randn(4, 6)


def body(x, y):
    return (x * y.sum()).tanh() + x.exp()


@pytest.mark.parametrize("dims", [(0, 1), (-3, -1), (1, None), (None, 0)])
def test_values_equal_torch_func_vmap(dims) -> None:
    x = X if dims[0] in (0, -3, None) else X.transpose(0, 1)
    want = vmap(body, in_dims=dims)(x, Y)
    torch.testing.assert_close(_compat.vmap_over_tensors(body, [x, Y], list(dims), "error"), want,
                               rtol=0, atol=0)


def test_an_unbatched_output_is_expanded_as_vmap_does() -> None:
    out = _compat.vmap_over_tensors(lambda x, y: y.sum(), [X, Y], [0, None], "error")
    torch.testing.assert_close(out, vmap(lambda x, y: y.sum(), in_dims=(0, None))(X, Y))
    assert out.shape == (6,)


@pytest.mark.parametrize("randomness", ["different", "same"])
def test_randomness(randomness) -> None:
    ones = torch.ones(64, 200)
    out = _compat.vmap_over_tensors(lambda x: F.dropout(x, 0.5), [ones], [0], randomness)
    same_masks = bool((out == out[0]).all())
    assert same_masks == (randomness == "same")
    with pytest.raises(RuntimeError, match="randomness"):
        _compat.vmap_over_tensors(lambda x: F.dropout(x, 0.5), [ones], [0], "error")
    with pytest.raises(RuntimeError, match="Only allowed values for randomness"):
        _compat.vmap_over_tensors(body, [X, Y], [0, 1], "sometimes")


def test_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match=r"same size in the mapped dimension, got sizes \[6, 4\]"):
        _compat.vmap_over_tensors(body, [X, Y], [0, 0], "error")
    with pytest.raises(ValueError, match="in_dims 3 is out of range .* 3 dimensions"):
        _compat.vmap_over_tensors(body, [X, Y], [3, 1], "error")
    with pytest.raises(ValueError, match="at least one argument must be batched"):
        _compat.vmap_over_tensors(body, [X, Y], [None, None], "error")
    with pytest.raises(TypeError, match="must return a tensor, got tuple"):
        _compat.vmap_over_tensors(lambda x, y: (x, y), [X, Y], [0, 1], "error")


def test_the_level_is_left_when_the_function_raises() -> None:
    def fails(x, y):
        raise KeyError("inside")
    with pytest.raises(KeyError):
        _compat.vmap_over_tensors(fails, [X, Y], [0, 1], "error")
    assert _compat.current_transform_level() is None


def test_saved_tensor_hooks_are_refused_inside_as_by_vmap() -> None:
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        with pytest.raises(RuntimeError, match="saved tensor hooks"):
            _compat.vmap_over_tensors(body, [X, Y], [0, 1], "error")


def loss(p, x, y):
    return F.cross_entropy(x @ p["w"], y)


def test_clipped_grad_takes_it_for_tensors_and_torch_func_vmap_for_pytrees(monkeypatch) -> None:
    p = {"w": torch.randn(4, 3, dtype=torch.float64)}
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    per = vmap(grad(loss), in_dims=(None, 0, 0))(p, x, y)["w"]
    norms = per.flatten(1).norm(dim=1)
    want = (per * (0.5 / (norms + 1e-6)).clamp(max=1).view(-1, 1, 1)).sum(0)
    calls = []
    monkeypatch.setattr(transform, "vmap_over_tensors",
                        lambda *a: calls.append(a) or _compat.vmap_over_tensors(*a))
    sums, got_norms = batchrules.clipped_grad(loss, 0.5)(p, x, y)
    assert len(calls) == 1
    torch.testing.assert_close(sums["w"], want)
    torch.testing.assert_close(got_norms, norms)
    # a pytree argument (x in a dict) goes through torch.func.vmap, with the same result
    sums, _ = batchrules.clipped_grad(lambda p, b: loss(p, b["x"], b["y"]), 0.5)(p, {"x": x, "y": y})
    assert len(calls) == 1
    torch.testing.assert_close(sums["w"], want)
