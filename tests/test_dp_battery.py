"""Property: clipped_grad equals the per-sample loop (float64) on random small
layer stacks — linear, conv1d/conv2d (grouped), embedding, LayerNorm,
self-attention — with a layer applied twice, an embedding tied to the output
head, frozen parameters, two differentiated arguments, a batch dim other than
0, and non-contiguous layouts between layers (transposes, cat with a parameter
token, flips, a linear output summed directly): no wrong norm, and no error.
"""
from typing import Any, Dict, List, Tuple

import torch
import torch.nn.functional as F
from dp_reference import loop_clipped_grad
from hypothesis import given, seed, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.func import functional_call

import batchrules

WIDTHS = (2, 4, 6)
CLASSES = 3
_NO_PARAMS = ("reuse", "tanh", "flip")


def _layer(draw: Any, width: int) -> Tuple[Tuple[Any, ...], int]:
    """One op on a per-sample [T, width] activation and its output width."""
    kind = draw(st.sampled_from(["attention", "token", "linear", "conv1d", "conv2d",
                                 "layer_norm", "tanh", "flip"]))
    if kind in ("linear", "conv1d", "conv2d"):
        out = draw(st.sampled_from(WIDTHS))
        groups = draw(st.sampled_from([g for g in (1, 2) if width % g == 0 and out % g == 0]))
        return (kind, out, draw(st.sampled_from([1, 3])), groups, draw(st.booleans())), out
    if kind == "layer_norm":
        return (kind, draw(st.booleans()), draw(st.booleans())), width
    if kind == "attention":
        return (kind, draw(st.sampled_from([1, 2])), draw(st.booleans())), width
    return (kind,), width


@st.composite
def stacks(draw: Any) -> Dict[str, Any]:
    embedding = draw(st.booleans())
    tied = embedding and draw(st.booleans())  # the output head is the embedding's table
    width = start = draw(st.sampled_from(WIDTHS))
    ops: List[Tuple[Any, ...]] = []
    shapes: List[int] = []  # each layer op's (in == out) width, for reuse
    for _ in range(draw(st.integers(1, 3))):
        if ops and draw(st.booleans()):  # apply an earlier layer again
            same = [i for i, op in enumerate(ops) if op[0] not in _NO_PARAMS and shapes[i] == width]
            if same:
                ops.append(("reuse", draw(st.sampled_from(same))))
                shapes.append(-1)
                continue
        op, out = _layer(draw, width)
        ops.append(op)
        shapes.append(width if out == width else -1)
        width = out
    if tied and width != start:
        ops.append(("linear", start, 1, 1, True))
    return dict(embedding=embedding, ops=ops, start=start, tied=tied, loss=draw(st.sampled_from(
                    ["sum", "mse", "cross_entropy"])),
                batch=draw(st.integers(1, 4)), length=draw(st.integers(1, 3)),
                batch_dim=draw(st.sampled_from([0, 1])), frozen=draw(st.integers(0, 2 ** 16)),
                split=draw(st.booleans()), seed=draw(st.integers(0, 2 ** 16)))


class Stack(nn.Module):
    def __init__(self, spec: Dict[str, Any]) -> None:
        super().__init__()
        self.ops = spec["ops"]
        width = self.first = spec["start"]
        self.embedding = nn.Embedding(5, width) if spec["embedding"] else None
        self.layers = nn.ModuleList()
        for op in self.ops:
            self.layers.append(self._make(op, width))
            if op[0] in ("linear", "conv1d", "conv2d"):
                width = op[1]
        self.head = None if spec["tied"] else nn.Linear(width, CLASSES)

    @staticmethod
    def _make(op: Tuple[Any, ...], width: int) -> nn.Module:
        kind = op[0]
        if kind == "linear":
            return nn.Linear(width, op[1], bias=op[4])
        if kind in ("conv1d", "conv2d"):
            _, out, k, groups, bias = op
            if kind == "conv1d":
                return nn.Conv1d(width, out, k, padding=k // 2, groups=groups, bias=bias)
            return nn.Conv2d(width, out, (k, 1), padding=(k // 2, 0), groups=groups, bias=bias)
        if kind == "layer_norm":
            return nn.LayerNorm(width, elementwise_affine=op[1], bias=op[2])
        if kind == "attention":
            return nn.MultiheadAttention(width, op[1], bias=op[2], batch_first=True)
        if kind == "token":
            return nn.ParameterList([nn.Parameter(torch.randn(1, width))])
        return nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        h = self.embedding(x) if self.embedding is not None else x  # T, width
        for op, layer in zip(self.ops, self.layers):
            if op[0] == "reuse":
                op, layer = self.ops[op[1]], self.layers[op[1]]
            h = self._run(op, layer, h)
        return F.linear(h, self.embedding.weight) if self.head is None else self.head(h)

    @staticmethod
    def _run(op: Tuple[Any, ...], layer: nn.Module, h: Tensor) -> Tensor:
        kind = op[0]
        if kind == "conv1d":  # channels first: transposed in, transposed out
            return layer(h.t()).t()
        if kind == "conv2d":
            return layer(h.t().unsqueeze(-1)).squeeze(-1).t()
        if kind == "attention":
            u = h.unsqueeze(0)  # the same tensor thrice: self-attention, which the rule takes
            return layer(u, u, u, need_weights=False)[0][0]
        if kind == "tanh":
            return h.tanh()
        if kind == "token":
            return torch.cat([layer[0], h], 0)
        if kind == "flip":
            return h.flip(0)
        return layer(h)


def _loss_fn(model: nn.Module, kind: str):
    def loss(p: Dict[str, Tensor], x: Tensor, q: Dict[str, Tensor], frozen: Dict[str, Tensor],
             y: Tensor) -> Tensor:
        out = functional_call(model, {**p, **q, **frozen}, (x,))
        if kind == "sum":  # a linear's output summed: a stride-0 output gradient
            return out.sum()
        if kind == "mse":
            return out.pow(2).mean()
        return F.cross_entropy(out.mean(0), y)
    return loss


def _assert_close(got: Any, want: Any) -> None:
    (got_p, got_q), got_norms = got
    (want_p, want_q), want_norms = want
    scale = want_norms.max().item()
    assert (got_norms - want_norms).abs().max().item() <= 1e-9 * scale, (got_norms, want_norms)
    for name, w in {**want_p, **want_q}.items():
        g = {**got_p, **got_q}[name]
        assert g.shape == w.shape and g.dtype == w.dtype
        assert (g - w).abs().max().item() <= 1e-9 * max(w.abs().max().item(), scale), name


@seed(16)
@settings(max_examples=50, deadline=None, database=None)
@given(stacks())
def test_random_stacks_match_the_per_sample_loop(spec: Dict[str, Any]) -> None:
    torch.manual_seed(spec["seed"])
    model = Stack(spec).double()
    named = dict(model.named_parameters())
    names = sorted(named)
    bits = spec["frozen"] & spec["frozen"] >> 8  # about a quarter frozen
    frozen = {k for i, k in enumerate(names) if bits >> i & 1}
    trained = [k for k in names if k not in frozen] or names[:1]
    frozen -= set(trained)
    first = set(trained[::2]) if spec["split"] else set(trained)
    p = {k: named[k].detach() for k in trained if k in first}
    q = {k: named[k].detach() for k in trained if k not in first}
    fixed = {k: named[k].detach() for k in frozen}
    b, t = spec["batch"], spec["length"]
    if spec["embedding"]:
        x = torch.randint(5, (b, t))
    else:
        x = torch.randn(b, t, model.first, dtype=torch.float64)
    x = x.movedim(0, spec["batch_dim"]).contiguous()
    y = torch.randint(CLASSES if model.head is not None else 5, (b,))
    loss = _loss_fn(model, spec["loss"])
    args, kw = (p, x, q, fixed, y), dict(argnums=(0, 2), in_dims=(None, spec["batch_dim"], None,
                                                                 None, 0))
    norms = loop_clipped_grad(loss, 1.0, args, **kw)[1]
    max_norm = max(norms.median().item(), 1e-3)  # some samples clipped, some not
    want = loop_clipped_grad(loss, max_norm, args, **kw)
    _assert_close(batchrules.clipped_grad(loss, max_norm, **kw)(*args), want)
