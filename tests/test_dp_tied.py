"""Parameters used by calls of several kinds (Note [Cross terms of tied
parameters] in dp/cost.py), against the per-sample loop in float64: GPT-2's
tied wte (an embedding and the lm_head's F.linear), a weight used by
torch.addmm and F.linear, a convolution applied twice; and no ``[b, *param]``
tensor formed for the tied weight while clipping.
"""

import pytest
import torch
import torch.nn.functional as F
from dp_reference import assert_close_rel, check_model
from torch import Tensor, nn

from batchrules.dp.cost import cross_inner
from batchrules.dp.rule import Factors

BATCH, VOCAB, DIM = 5, 13, 6


class TinyGPT(nn.Module):
    """Token and position embeddings, a residual MLP, a LayerNorm, and logits
    through the token table (GPT-2's tied lm_head)."""

    def __init__(self, rows: int, **embedding: object) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM, **embedding)  # type: ignore[arg-type]
        self.wpe = nn.Embedding(rows, DIM)
        self.fc = nn.Linear(DIM, DIM)
        self.ln = nn.LayerNorm(DIM)

    def forward(self, idx: Tensor) -> Tensor:  # [N, T] -> [N, T, V]
        h = self.wte(idx) + self.wpe(torch.arange(idx.shape[-1]))
        h = self.ln(h + self.fc(h).tanh())
        return F.linear(h, self.wte.weight)


def lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())  # -100: ignored


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("config", [{}, {"padding_idx": 2}, {"scale_grad_by_freq": True},
                                    {"scale_grad_by_freq": True, "padding_idx": 0}],
                         ids=["plain", "padding", "freq", "freq_padding"])
def test_tied_embedding_and_lm_head(kinds, clip_shapes, rows: int, config) -> None:
    torch.manual_seed(0)
    idx = torch.randint(0, VOCAB, (BATCH, rows))
    idx[:, rows // 2:] = idx[:, :(rows + 1) // 2]  # repeated tokens within a sample
    idx[0, 0] = config.get("padding_idx", 0)
    labels = torch.randint(0, VOCAB, (BATCH, rows))
    if rows > 1:
        labels[1:, 0] = -100
    check_model(TinyGPT(rows, **config), idx, labels, lm_loss)
    assert kinds["wte.weight"] == "tied"
    assert kinds["fc.weight"] == "linear" and kinds["wpe.weight"] == "embedding"
    # Neither an embedding's [b, V, D] (or [b*V, D]) nor a linear's per-sample gradient.
    table = VOCAB * DIM
    formed = [s for s in clip_shapes if torch.Size(s).numel() % table == 0
              and torch.Size(s).numel() > table]
    assert not formed, formed


def test_tied_ghost_pairs_chunked(monkeypatch) -> None:
    """The cross terms in several chunks (Note [Bounded transients]) give the same norms."""
    from batchrules.dp import cost

    torch.manual_seed(1)
    idx, labels = torch.randint(0, VOCAB, (BATCH, 6)), torch.randint(0, VOCAB, (BATCH, 6))
    calls = []
    original = cost.chunked

    def chunked(batch, per_sample, budget, fn):
        calls.append(batch)
        return original(batch, per_sample, per_sample * 2, fn)  # two samples a chunk

    monkeypatch.setattr(cost, "chunked", chunked)
    check_model(TinyGPT(6), idx, labels, lm_loss)
    assert calls


class AddmmAndLinear(nn.Module):
    """``W: [I, O]`` used by torch.addmm (as GPT-2's Conv1D) and, transposed, by F.linear."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 7) * 0.5)
        self.b = nn.Parameter(torch.randn(7) * 0.1)
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:  # [N, T, 4] -> [N, T, 3]
        h = torch.addmm(self.b, x.view(-1, 4), self.w).tanh()
        return self.head(F.linear(h, self.w).tanh()).view(*x.shape[:-1], 3)


@pytest.mark.parametrize("rows", [1, 3, 40], ids=["one_row", "ghost", "materialized"])
def test_weight_of_addmm_and_linear(kinds, rows: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(BATCH, rows, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (BATCH, rows))
    check_model(AddmmAndLinear(), x, y, lm_loss, max_norm=0.1)
    assert kinds == {"w": "tied", "b": "bias", "head.weight": "linear", "head.bias": "bias"}


class ConvTwice(nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1, groups=groups)
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv(self.conv(x).tanh()).tanh()
        return self.head(h.mean((-1, -2)))


@pytest.mark.parametrize("groups,kind", [(1, "tied"), (2, "materialized")])
@pytest.mark.parametrize("side", [2, 6], ids=["ghost", "materialized"])
def test_conv_applied_twice(kinds, groups: int, kind: str, side: int) -> None:
    """Two calls ConvUse does not factor together: each its own part, with a
    cross term (one group), or materialized (groups: no factors)."""
    torch.manual_seed(0)
    x = torch.randn(BATCH, 4, side, side, dtype=torch.float64)
    check_model(ConvTwice(groups), x, torch.randint(0, 3, (BATCH,)), F.cross_entropy)
    assert kinds["conv.weight"] == kind and kinds["conv.bias"] == "bias"


def _factors(u: Tensor, v: Tensor, p: int) -> Factors:
    indexed = u.dtype == torch.int64
    return Factors(u.shape[0], u.shape[1], p, v.shape[-1], indexed, lambda s: (u[s], v[s]))


def _dense(f: Factors) -> Tensor:
    """``[B, P, Q]``: the factors' gradients, materialized."""
    u, v = f.at(slice(0, f.batch))
    if f.indexed:
        u = F.one_hot(u, f.p).to(v.dtype)
    return torch.einsum("btp,btq->bpq", u, v)


@pytest.mark.parametrize("u_a,u_b,rows,p,q", [
    ("dense", "dense", 2, 9, 4), ("dense", "dense", 7, 3, 2), ("index", "dense", 2, 9, 4),
    ("dense", "index", 2, 9, 4), ("index", "index", 2, 9, 4)],
    ids=["dense_ghost", "dense_materialized", "index_dense", "dense_index", "index_index"])
def test_cross_inner_against_materialized(u_a: str, u_b: str, rows: int, p: int, q: int) -> None:
    """Every way of Note [Cross terms of tied parameters], against <G_a, G_b> of dense gradients."""
    g = torch.Generator().manual_seed(0)

    def make(u_kind: str, t: int) -> Factors:
        u = (torch.randint(0, p, (BATCH, t), generator=g) if u_kind == "index"
             else torch.randn(BATCH, t, p, generator=g, dtype=torch.float64))
        return _factors(u, torch.randn(BATCH, t, q, generator=g, dtype=torch.float64), p)

    a, b = make(u_a, rows), make(u_b, rows + 1)
    assert_close_rel(cross_inner(a, b), (_dense(a) * _dense(b)).flatten(1).sum(1))
