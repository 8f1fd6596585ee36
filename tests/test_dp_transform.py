"""clipped_grad's contract: in_dims, argnums, has_aux, pytrees, batch sizes, and
parameters used in ways no rule handles, against a per-sample loop in float64."""
import itertools
from typing import Dict

import pytest
import torch
import torch.nn.functional as F
from dp_reference import assert_close_rel, loop_clipped_grad
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

import batchrules


@pytest.fixture(autouse=True)
def float64_default():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def mlp_params(seed: int = 0) -> Dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w1": torch.randn(6, 4, generator=g), "b1": torch.randn(6, generator=g),
            "w2": torch.randn(3, 6, generator=g), "b2": torch.randn(3, generator=g)}


def mlp_loss(p: Dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
    h = F.linear(x, p["w1"], p["b1"]).tanh()
    return F.cross_entropy(F.linear(h, p["w2"], p["b2"]), y)


BATCH = 4


def batched(shape, dim, seed=1):
    g = torch.Generator().manual_seed(seed)
    if dim is None:
        return torch.randn(*shape, generator=g)
    full = list(shape)
    full.insert(dim, BATCH)
    return torch.randn(*full, generator=g)


def labels(dim):
    g = torch.Generator().manual_seed(2)
    return torch.randint(3, (BATCH,) if dim is not None else (), generator=g)


@pytest.mark.parametrize("x_dim,y_dim", [(xd, yd) for xd, yd in itertools.product((0, 1, None),
                                                                                (0, None))
                                         if (xd, yd) != (None, None)])
def test_every_in_dims_combination(x_dim, y_dim) -> None:
    """x: one sample is [2, 4] (two rows), batched at dim 0 or 1 or shared; y batched or shared."""
    params = mlp_params()
    x = batched((2, 4), x_dim)
    y = labels(y_dim)

    def loss(p, xi, yi):
        return mlp_loss(p, xi, yi.expand(2))

    in_dims = (None, x_dim, y_dim)
    if y_dim is None:
        y = y.expand(())  # a 0-d label shared by all samples
    want = loop_clipped_grad(loss, 1.0, (params, x, y), in_dims=in_dims)
    got = batchrules.clipped_grad(loss, 1.0, in_dims=in_dims)(params, x, y)
    assert_close_rel(got, want)


def test_in_dims_pytree_and_default() -> None:
    params = mlp_params()
    batch = {"x": batched((4,), 1), "scale": torch.tensor(2.0)}
    y = labels(0)

    def loss(p, b, yi):
        return mlp_loss(p, b["x"] * b["scale"], yi)

    in_dims = (None, {"x": 1, "scale": None}, 0)
    assert_close_rel(batchrules.clipped_grad(loss, 0.7, in_dims=in_dims)(params, batch, y),
                     loop_clipped_grad(loss, 0.7, (params, batch, y), in_dims=in_dims))
    # omitted in_dims: None for the differentiated argument, 0 for the others
    x = batched((4,), 0)
    assert_close_rel(batchrules.clipped_grad(mlp_loss, 0.7)(params, x, y),
                     loop_clipped_grad(mlp_loss, 0.7, (params, x, y), in_dims=(None, 0, 0)))


@pytest.mark.parametrize("argnums", [(0, 1), (1, 0), (-4, 1), 1])
def test_argnums(argnums) -> None:
    p = mlp_params()
    first, second = {"w1": p["w1"], "b1": p["b1"]}, [p["w2"], p["b2"]]

    def loss(a, b, xi, yi):
        return mlp_loss({**a, "w2": b[0], "b2": b[1]}, xi, yi)

    args = (first, second, batched((4,), 0), labels(0))
    in_dims = (None, None, 0, 0)
    got = batchrules.clipped_grad(loss, 0.5, argnums=argnums, in_dims=in_dims)(*args)
    want = loop_clipped_grad(loss, 0.5, args, in_dims=in_dims, argnums=tuple(q % 4 for q in argnums)
                             if isinstance(argnums, tuple) else argnums)
    assert_close_rel(got, want)
    assert isinstance(got[0], tuple) == isinstance(argnums, tuple)


def test_has_aux() -> None:
    params, x, y = mlp_params(), batched((4,), 0), labels(0)

    def loss(p, xi, yi):
        logits = F.linear(F.linear(xi, p["w1"], p["b1"]).tanh(), p["w2"], p["b2"])
        return F.cross_entropy(logits, yi), {"logits": logits, "pred": logits.argmax()}

    (got, norms), aux = batchrules.clipped_grad(loss, 0.5, has_aux=True)(params, x, y)
    want = loop_clipped_grad(loss, 0.5, (params, x, y), has_aux=True)
    assert_close_rel((got, norms), want)
    _, ref_aux = vmap(grad(loss, has_aux=True), in_dims=(None, 0, 0))(params, x, y)
    torch.testing.assert_close(aux, ref_aux)
    assert aux["logits"].grad_fn is None
    assert not norms.requires_grad and not any(s.requires_grad for s in got.values())


def test_params_as_tensor_list_and_parameters() -> None:
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    x, y = batched((4,), 0), labels(0)

    def loss(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi,)), yi)

    live = dict(model.named_parameters())  # nn.Parameters that require grad: fine too
    assert_close_rel(batchrules.clipped_grad(loss, 0.5)(live, x, y),
                     loop_clipped_grad(loss, 0.5, (live, x, y)))
    assert all(p.grad is None for p in model.parameters())

    w = torch.randn(3, 4)
    single = batchrules.clipped_grad(lambda w_, xi, yi: F.cross_entropy(F.linear(xi, w_), yi), 0.5)
    assert_close_rel(single(w, x, y),
                     loop_clipped_grad(lambda w_, xi, yi: F.cross_entropy(F.linear(xi, w_), yi),
                                       0.5, (w, x, y)))


@pytest.mark.parametrize("batch", [0, 1])
def test_tiny_batches(batch: int) -> None:
    params, x, y = mlp_params(), torch.randn(batch, 4), torch.randint(3, (batch,))
    sums, norms = batchrules.clipped_grad(mlp_loss, 1.0)(params, x, y)
    assert norms.shape == (batch,)
    if batch == 0:
        assert all(torch.equal(s, torch.zeros_like(params[k])) for k, s in sums.items())
    assert_close_rel((sums, norms), loop_clipped_grad(mlp_loss, 1.0, (params, x, y)))


def test_empty_batch_skips_the_loss() -> None:
    """Note [An empty batch]: zero sums and no norms, without running the loss
    (vmap over zero samples cannot run ``reshape(-1, n)``; eager can)."""
    calls = []

    def loss(p, xi, shift):
        calls.append(1)
        h = F.linear((xi + shift).reshape(-1, 4), p["w1"], p["b1"]).tanh()  # [1, 4] rows
        return F.linear(h, p["w2"], p["b2"]).square().sum()

    params = {k: v.float() for k, v in mlp_params().items()}
    x, shift = torch.randn(0, 2, 2, dtype=torch.float32), torch.zeros(2, 2, dtype=torch.float32)
    sums, norms = batchrules.clipped_grad(loss, 1.0, in_dims=(None, 0, None))(params, x, shift)
    assert norms.shape == (0,) and norms.dtype == torch.float32
    assert all(not s.any() and s.shape == params[k].shape for k, s in sums.items())
    (sums, shift_sum), norms = batchrules.clipped_grad(loss, 1.0, argnums=(0, 2),
                                                       in_dims=(None, 0, None))(params, x, shift)
    assert norms.shape == (0,) and not shift_sum.any() and shift_sum.shape == (2, 2)
    assert not calls
    with pytest.raises(ValueError, match="vmap"):  # sizes that disagree: vmap's own error
        batchrules.clipped_grad(mlp_loss, 1.0)(mlp_params(), torch.randn(0, 4),
                                               torch.zeros(3, dtype=torch.int64))


class ZeroFeatures(nn.Module):
    """A linear over inputs with no features, ``Linear(0, 4)`` on T rows (eager runs it)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(0, 4), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.lin(x).sum(1))  # x: [N, T, 0]


@pytest.mark.parametrize("steps", [1, 3])
def test_zero_features(steps: int) -> None:
    """No reshape infers a dim (``-1``) that no features make ambiguous."""
    model = ZeroFeatures()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    args = (params, torch.randn(4, steps, 0), torch.tensor([0, 1, 2, 0]))
    assert_close_rel(batchrules.clipped_grad(loss, 0.5)(*args), loop_clipped_grad(loss, 0.5, args))


def test_empty_batch_with_aux_runs_the_loss() -> None:
    def loss(p, xi, yi):
        logits = F.linear(F.linear(xi, p["w1"], p["b1"]).tanh(), p["w2"], p["b2"])
        return F.cross_entropy(logits, yi), logits

    (sums, norms), aux = batchrules.clipped_grad(loss, 1.0, has_aux=True)(
        mlp_params(), torch.randn(0, 4), torch.zeros(0, dtype=torch.int64))
    assert norms.shape == (0,) and aux.shape == (0, 3) and not any(s.any() for s in sums.values())


def test_no_clipping_is_the_summed_gradient() -> None:
    params, x, y = mlp_params(), batched((4,), 0), labels(0)
    sums, norms = batchrules.clipped_grad(mlp_loss, 1e6)(params, x, y)
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    total = F.cross_entropy(F.linear(F.linear(x, leaves["w1"], leaves["b1"]).tanh(), leaves["w2"],
                                     leaves["b2"]), y, reduction="sum")
    want = dict(zip(leaves, torch.autograd.grad(total, list(leaves.values()))))
    assert_close_rel(sums, want)


def test_tied_linear_uses_and_mixed_uses() -> None:
    """A weight applied twice (its rows concatenate), one also in a regularizer
    (materialized), one used by hand (x @ W.T), and one unused."""
    g = torch.Generator().manual_seed(3)
    params = {"w": torch.randn(4, 4, generator=g), "v": torch.randn(3, 4, generator=g),
              "u": torch.randn(4, 4, generator=g), "unused": torch.randn(2, generator=g)}

    def loss(p, xi, yi):
        h = F.linear(F.linear(xi, p["w"]).tanh(), p["w"]).tanh()
        h = h @ p["u"].T
        reg = 0.1 * p["v"].square().sum()
        return F.cross_entropy(F.linear(h, p["v"]), yi) + reg

    args = (params, batched((4,), 0), labels(0))
    assert_close_rel(batchrules.clipped_grad(loss, 0.5)(*args), loop_clipped_grad(loss, 0.5, args))


def test_outputs_modified_in_place() -> None:
    """Note [Tapping an output that may later change in place]: in place on an
    output and on a view of it."""
    params, x, y = mlp_params(), batched((4,), 0), labels(0)

    def loss(p, xi, yi):
        h = F.linear(xi, p["w1"], p["b1"])
        h[:2].mul_(3.0)
        h.tanh_()
        logits = F.linear(h, p["w2"], p["b2"])
        logits.add_(1.0)
        return F.cross_entropy(logits, yi)

    assert_close_rel(batchrules.clipped_grad(loss, 0.5)(params, x, y),
                     loop_clipped_grad(loss, 0.5, (params, x, y)))


def test_batchrules_linear_and_nested_vmap_in_the_loss() -> None:
    params = mlp_params()

    def loss(p, xi, yi):
        h = batchrules.linear(xi, p["w1"], p["b1"]).tanh()
        # an inner vmap over the rows: the linear runs at an inner level
        logits = vmap(lambda row: F.linear(row, p["w2"], p["b2"]))(h)
        return F.cross_entropy(logits, yi)

    args = (params, batched((2, 4), 0), torch.randint(3, (BATCH, 2)))
    assert_close_rel(batchrules.clipped_grad(loss, 0.5)(*args), loop_clipped_grad(loss, 0.5, args))


def test_loss_independent_of_params() -> None:
    params, x, y = mlp_params(), batched((4,), 0), labels(0)
    sums, norms = batchrules.clipped_grad(lambda p, xi, yi: xi.sum(), 1.0)(params, x, y)
    assert torch.equal(norms, torch.zeros(BATCH))
    assert all(torch.equal(s, torch.zeros_like(params[k])) for k, s in sums.items())


def test_float32_and_repeated_calls() -> None:
    params = {k: v.float() for k, v in mlp_params().items()}
    x, y = batched((4,), 0).float(), labels(0)
    step = batchrules.clipped_grad(mlp_loss, 0.5)
    first, second = step(params, x, y), step(params, x, y)
    want = loop_clipped_grad(mlp_loss, 0.5, ({k: v.double() for k, v in params.items()}, x.double(), y))
    assert first[1].dtype == torch.float32
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    torch.testing.assert_close((first[0], first[1]), tuple(
        {k: v.float() for k, v in t.items()} if isinstance(t, dict) else t.float() for t in want),
        rtol=1e-5, atol=1e-6)


def test_dropout_with_vmap_randomness() -> None:
    """randomness means what it means for vmap: "same" draws one mask for all samples."""
    params, x, y = mlp_params(), batched((4,), 0), labels(0)

    def loss(p, xi, yi):
        return mlp_loss({**p, "w1": p["w1"]}, F.dropout(xi, 0.5), yi)

    torch.manual_seed(5)
    got = batchrules.clipped_grad(loss, 0.5, randomness="same")(params, x, y)
    torch.manual_seed(5)
    per = vmap(grad(loss), in_dims=(None, 0, 0), randomness="same")(params, x, y)
    norms = torch.cat([g.flatten(1) for g in per.values()], 1).norm(dim=1)
    assert_close_rel(got[1], norms)
