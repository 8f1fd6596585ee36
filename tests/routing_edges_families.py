"""What the property test of routing_edges_cases.py draws: a Case (one
example's function, its batched arguments, their in_dims, a dtype and a
transform) per routed family, from hypothesis' draws (Draw)."""
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.testing import make_tensor

import batchrules

DTYPES = ["float32", "float64", "bfloat16", "autocast"]


@dataclass
class Case:
    fn: Callable[..., Tensor]     # one example's function, returning one tensor
    args: List[Tensor]            # batched (or shared) arguments
    in_dims: Tuple[Optional[int], ...]
    dtype: str                    # one of DTYPES
    transform: str                # vmap, vmap_grad or vmap_vmap (args then batched twice)
    batch: Tuple[int, ...]        # the vmap sizes, outermost first


class Draw:
    """Hypothesis' draws for one case: sizes, layouts and dtypes."""

    def __init__(self, data: st.DataObject, transform: Optional[str] = None) -> None:
        self.data = data
        self.dtype_name = data.draw(st.sampled_from(DTYPES), label="dtype")
        self.transform = transform or data.draw(
            st.sampled_from(["vmap", "vmap", "vmap_grad", "vmap_vmap"]), label="transform")
        outer = [data.draw(st.integers(0, 3), label="batch")]
        if self.transform == "vmap_vmap":
            outer.append(data.draw(st.integers(0, 2), label="inner batch"))
        self.batch = tuple(outer)

    @property
    def dtype(self) -> torch.dtype:
        """The tensors' dtype (float32 under autocast)."""
        return {"float64": torch.float64, "bfloat16": torch.bfloat16}.get(self.dtype_name,
                                                                         torch.float32)

    def size(self, low: int = 0, high: int = 3, label: str = "size") -> int:
        return self.data.draw(st.integers(low, high), label=label)

    def flag(self, label: str) -> bool:
        return self.data.draw(st.booleans(), label=label)

    def choice(self, options: Sequence[Any], label: str) -> Any:
        return self.data.draw(st.sampled_from(list(options)), label=label)

    def tensor(self, shape: Sequence[int], batched: bool = True, dtype: Optional[torch.dtype] = None,
               low: Optional[float] = None, high: Optional[float] = None
               ) -> Tuple[Tensor, Optional[int]]:
        """A batched argument of per-example ``shape`` (its vmap dims at random
        positions, possibly non-contiguous or expanded), or a shared one."""
        dtype = dtype or self.dtype
        noncontiguous = self.flag("noncontiguous")
        if not batched:
            return make_tensor(tuple(shape), dtype=dtype, device="cpu", low=low, high=high,
                               noncontiguous=noncontiguous), None
        expanded = self.flag("expanded")
        lead = (1,) * len(self.batch) if expanded else tuple(self.batch)
        t = make_tensor(lead + tuple(shape), dtype=dtype, device="cpu", low=low, high=high,
                        noncontiguous=noncontiguous).expand(tuple(self.batch) + tuple(shape))
        # [B0, (B1,) *shape]: B1 to its place among the example's dims, then B0
        # to its place among all; each level's in_dim is its position in what
        # the enclosing levels leave.
        dims = []
        if len(self.batch) == 2:
            inner = self.data.draw(st.integers(0, len(shape)), label="inner in_dim")
            t = t.movedim(1, 1 + inner)
            dims.append(inner)
        outer = self.data.draw(st.integers(0, t.dim() - 1), label="in_dim")
        dims.insert(0, outer)
        return t.movedim(0, outer), dims[0] if len(dims) == 1 else tuple(dims)

    def module(self, module: nn.Module) -> nn.Module:
        return module.to(self.dtype)

    def case(self, fn: Callable[..., Tensor], *args: Tuple[Tensor, Any]) -> Case:
        tensors = [a for a, _ in args]
        dims = tuple(d for _, d in args)
        return Case(fn, tensors, dims, self.dtype_name, self.transform, self.batch)


# ---- the families -----------------------------------------------------------------


def linear_case(d: Draw) -> Case:
    n, i, o = d.size(label="rows"), d.size(label="in"), d.size(label="out")
    x = d.tensor([n, i])
    w = d.tensor([o, i], batched=d.flag("batched weight"))
    b = d.tensor([o], batched=d.flag("batched bias")) if d.flag("bias") else None
    if b is None:
        return d.case(lambda x, w: F.linear(x, w), x, w)
    return d.case(F.linear, x, w, b)


def addmm_case(d: Draw) -> Case:
    n, k, m = d.size(label="rows"), d.size(label="k"), d.size(label="m")
    bias_shape = d.choice([[m], [1, m], [n, m], []], "bias shape")
    return d.case(torch.addmm, d.tensor(bias_shape, batched=d.flag("batched bias")),
                  d.tensor([n, k]), d.tensor([k, m], batched=d.flag("batched weight")))


def activation_case(fn: Callable[[Tensor], Tensor]) -> Callable[[Draw], Case]:
    def case(d: Draw) -> Case:
        shape = [d.size(label="dim") for _ in range(d.size(0, 2, "rank"))]
        return d.case(fn, d.tensor(shape))
    return case


def cross_entropy_case(d: Draw) -> Case:
    n, c = d.size(label="rows"), d.size(1, 4, "classes")
    reduction = d.choice(["mean", "sum", "none"], "reduction")
    spatial = [d.size(label="spatial")] if d.flag("spatial") else []
    logits = d.tensor([n, c] + spatial)
    target = d.tensor([n] + spatial, batched=d.flag("batched target"), dtype=torch.long,
                      low=0, high=c)
    smoothing = d.choice([0.0, 0.1], "label smoothing")
    nll = d.flag("nll")
    if nll:
        return d.case(lambda x, t: F.nll_loss(x, t, reduction=reduction), logits, target)
    return d.case(lambda x, t: F.cross_entropy(x, t, reduction=reduction,
                                               label_smoothing=smoothing), logits, target)


def regression_case(d: Draw) -> Case:
    shape = [d.size(label="dim") for _ in range(d.size(0, 2, "rank"))]
    loss = d.choice([F.mse_loss, F.smooth_l1_loss, F.huber_loss], "loss")
    reduction = d.choice(["mean", "sum", "none"], "reduction")
    return d.case(lambda x, t: loss(x, t, reduction=reduction), d.tensor(shape),
                  d.tensor(shape, batched=d.flag("batched target")))


def sdpa_case(d: Draw) -> Case:
    b, h, lq, s, e = (d.size(label=n) for n in ("b", "heads", "L", "S", "E"))
    causal = d.flag("causal")
    q = d.tensor([b, h, lq, e])
    k, v = d.tensor([b, h, s, e], batched=d.flag("batched k")), d.tensor([b, h, s, e])
    return d.case(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                  q, k, v)


def mha_case(d: Draw) -> Case:
    heads = d.choice([1, 2], "heads")
    embed = heads * d.size(1, 3, "head dim")
    m = d.module(nn.MultiheadAttention(embed, heads, batch_first=True)).eval()
    n, length = d.size(label="rows"), d.size(label="length")
    return d.case(lambda x: m(x, x, x, need_weights=False)[0], d.tensor([n, length, embed]))


def encoder_case(d: Draw) -> Case:
    heads = d.choice([1, 2], "heads")
    embed = heads * d.size(1, 3, "head dim")
    m = d.module(nn.TransformerEncoderLayer(embed, heads, dim_feedforward=4, dropout=0.0,
                                            batch_first=True, norm_first=d.flag("norm first")))
    n, length = d.size(label="rows"), d.size(label="length")
    return d.case(m, d.tensor([n, length, embed]))


def rnn_case(kind: str) -> Callable[[Draw], Case]:
    def case(d: Draw) -> Case:
        layers, bidirectional, batch_first = d.size(1, 2, "layers"), d.flag("bidir"), d.flag("bf")
        # nn's RNN modules refuse 0 features.
        features, hidden = d.size(1, 3, "features"), d.size(1, 3, "hidden")
        m = d.module(getattr(nn, kind)(features, hidden, num_layers=layers,
                                       bidirectional=bidirectional, batch_first=batch_first))
        t, n = d.size(label="steps"), d.size(label="rows")
        unbatched = d.flag("unbatched example")
        shape = [t, features] if unbatched else ([n, t, features] if batch_first
                                                 else [t, n, features])
        return d.case(lambda x: m(x)[0], d.tensor(shape))
    return case


def cell_case(kind: str) -> Callable[[Draw], Case]:
    def case(d: Draw) -> Case:
        features, hidden, n = d.size(label="features"), d.size(1, 3, "hidden"), d.size(label="rows")
        m = d.module(getattr(nn, kind)(features, hidden))
        x = d.tensor([n, features])
        h = d.tensor([n, hidden], batched=d.flag("batched state"))
        if kind == "LSTMCell":
            return d.case(lambda x, h: m(x, (h, torch.zeros_like(h)))[1], x, h)
        return d.case(m, x, h)
    return case


def clipped_grad_case(d: Draw) -> Case:
    """clipped_grad's norms and clipped sum over the drawn batch (vmap only:
    the batch is the examples the transform sums over)."""
    features, hidden, classes = d.size(1, 3, "features"), d.size(1, 3, "hidden"), d.size(1, 3, "c")
    model = d.module(nn.Sequential(nn.Linear(features, hidden), nn.SiLU(),
                                   nn.Linear(hidden, classes)))
    params = {k: p.detach() for k, p in model.named_parameters()}

    def loss(p: Dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(torch.func.functional_call(model, p, (x,)), y)

    def dp(x: Tensor, y: Tensor) -> Tensor:  # x, y: the whole batch
        total, norms = batchrules.clipped_grad(loss, 1.0, in_dims=(None, 0, 0))(params, x, y)
        return torch.cat([norms] + [g.flatten() for g in total.values()])

    def reference(x: Tensor, y: Tensor) -> Tensor:
        grads = [torch.func.grad(loss)(params, xi, yi) for xi, yi in zip(x, y)]
        norms = torch.stack([torch.cat([g.flatten() for g in gi.values()]).norm()
                             for gi in grads]) if grads else torch.zeros(0, dtype=x.dtype)
        scale = (1.0 / (norms + 1e-6)).clamp(max=1.0)
        total = {k: sum((s * gi[k] for s, gi in zip(scale, grads)), torch.zeros_like(v))
                 for k, v in params.items()}
        return torch.cat([norms] + [g.flatten() for g in total.values()])

    b = d.batch[0]
    x = make_tensor((b, features), dtype=d.dtype, device="cpu")
    y = make_tensor((b,), dtype=torch.long, device="cpu", low=0, high=classes)
    return Case(lambda x, y: (dp, reference), [x, y], (0, 0), d.dtype_name, "whole", d.batch)


FAMILIES: Dict[str, Callable[[Draw], Case]] = {
    "linear": linear_case, "addmm": addmm_case, "silu": activation_case(F.silu),
    "mish": activation_case(F.mish), "cross_entropy": cross_entropy_case,
    "regression_losses": regression_case, "sdpa": sdpa_case, "mha": mha_case,
    "encoder_layer": encoder_case, "lstm": rnn_case("LSTM"), "gru": rnn_case("GRU"),
    "rnn": rnn_case("RNN"), "lstm_cell": cell_case("LSTMCell"), "gru_cell": cell_case("GRUCell"),
    "rnn_cell": cell_case("RNNCell"), "clipped_grad": clipped_grad_case,
}
# clipped_grad vmaps itself: its cases run once over the whole batch.
WHOLE_BATCH = {"clipped_grad"}
