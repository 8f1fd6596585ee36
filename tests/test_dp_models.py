"""clipped_grad on every layer kind it handles, against a per-sample loop in float64.

Each model runs through ``functional_call`` with the params from
``named_parameters()``, as the torch.func recipe does; the kinds the
parameters were handled as are checked too, so a rule silently falling back
to per-sample copies fails here.
"""
import math
from typing import Tuple

import pytest
import torch
import torch.nn.functional as F
from dp_reference import BATCH, assert_close_rel, check_model, data, loop_clipped_grad
from torch import Tensor, nn
from torch.func import functional_call

import batchrules
from batchrules.dp.cost import ghost_is_cheaper
from batchrules.dp.layers import conv as conv_rule


def test_mlp_one_row(routing, kinds) -> None:
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=True), nn.Linear(8, 3))
    check_model(model, *data(6))
    assert kinds == {"0.weight": "linear", "0.bias": "bias", "2.weight": "linear", "2.bias": "bias"}


def seq_loss(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.flatten(0, -2), y.expand(out.shape[:-1]).flatten())


@pytest.mark.parametrize("rows,width", [(2, 16), (40, 3)], ids=["ghost", "materialized"])
def test_linear_on_sequences(routing, rows: int, width: int) -> None:
    """[T, d] per sample: the ghost norm for short sequences through wide
    layers, the materialized one for long sequences through narrow layers."""
    assert ghost_is_cheaper(rows, width, width) == (rows == 2)
    model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 3, bias=False))
    check_model(model, *data(rows, width), loss_fn=seq_loss, max_norm=0.3)


def test_linear_with_leading_dims(routing) -> None:
    model = nn.Sequential(nn.Linear(4, 5), nn.SiLU(), nn.Linear(5, 3))
    check_model(model, *data(2, 3, 4), loss_fn=seq_loss, unsqueeze=False)


CONVS = {
    "conv2d": (lambda: nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(),
                                     nn.Conv2d(4, 4, 3, stride=2, dilation=1), nn.Flatten(),
                                     nn.Linear(36, 3)), (2, 7, 7)),
    "conv2d_groups_dilation": (lambda: nn.Sequential(
        nn.Conv2d(4, 6, (3, 2), padding=(2, 1), dilation=2, groups=2), nn.Tanh(), nn.Flatten(),
        nn.Linear(6 * 7 * 7, 3)), (4, 7, 7)),
    "conv2d_same_no_bias": (lambda: nn.Sequential(
        nn.Conv2d(2, 3, 3, padding="same", bias=False), nn.Flatten(), nn.Linear(3 * 25, 3)),
        (2, 5, 5)),
    "conv1d": (lambda: nn.Sequential(nn.Conv1d(3, 4, 3, stride=2, padding=2), nn.ReLU(),
                                     nn.Conv1d(4, 2, 2, groups=2), nn.Flatten(),
                                     nn.Linear(10, 3)), (3, 9)),
    "conv2d_reflect": (lambda: nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1, padding_mode="reflect"), nn.Flatten(), nn.Linear(50, 3)),
        (1, 5, 5)),
    # Note [Convolution norms]: per-sample gradients too large to keep (576 > 4*36 + 16*16
    # elements per sample): materialized in chunks
    "conv2d_chunked": (lambda: nn.Sequential(nn.Conv2d(4, 16, 3), nn.Flatten(), nn.Linear(256, 3)),
                       (4, 6, 6)),
    # two output positions, 72 inputs, 8 outputs: the ghost norm over unfolded patches
    "conv2d_ghost": (lambda: nn.Sequential(nn.Conv2d(8, 8, 3), nn.Flatten(), nn.Linear(16, 3)),
                     (8, 3, 4)),
}


@pytest.mark.parametrize("name", list(CONVS))
def test_conv(routing, kinds, name: str) -> None:
    assert ghost_is_cheaper(2, 72, 8) and not ghost_is_cheaper(16, 36, 16)
    make, shape = CONVS[name]
    check_model(make(), *data(*shape))
    conv_kinds = {k: v for k, v in kinds.items() if k.startswith("0.")}
    assert conv_kinds["0.weight"] == "conv"


@pytest.mark.parametrize("bias", [False, True])
def test_conv_few_output_positions_take_the_gemm(routing, kinds, monkeypatch, bias: bool) -> None:
    """Note [Convolutions with few output positions]: a ResNet's last stages
    (3x3, padding 1, on a 2x2 input; strided to 1x1) take the patches' GEMM,
    over the patches their ghost norm unfolded."""
    shapes = []
    original = conv_rule.clipped_gemm

    def counted(x, y, c, writable):
        shapes.append((tuple(x.shape), tuple(y.shape)))
        return original(x, y, c, writable)

    monkeypatch.setattr(conv_rule, "clipped_gemm", counted)
    unfolds = []
    patches = conv_rule.ConvUse.patches
    monkeypatch.setattr(conv_rule.ConvUse, "patches",
                        lambda use, s: unfolds.append(s) or patches(use, s))
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=bias), nn.ReLU(),
                          nn.Conv2d(8, 6, 3, stride=2, padding=1, bias=bias), nn.Flatten(),
                          nn.Linear(6, 3))
    check_model(model, *data(3, 2, 2))
    # B,rows,O x B,rows,C*k: 4 output positions, then 1
    assert sorted(shapes) == [((BATCH, 1, 6), (BATCH, 1, 72)), ((BATCH, 4, 8), (BATCH, 4, 27))]
    assert unfolds == [slice(0, BATCH)] * 2  # once a conv, whole-batch: the norm's, kept for the sum
    assert kinds["0.weight"] == kinds["2.weight"] == "conv"


def test_conv_unbatched_per_sample_input(routing) -> None:
    """A conv given one [C, H, W] image per sample (no unsqueeze)."""
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(0), nn.Linear(3 * 9, 3))
    check_model(model, *data(2, 5, 5), unsqueeze=False, loss_fn=F.cross_entropy)


def test_conv_several_images_per_sample(routing) -> None:
    """N > 1 images per sample (a sample is a small set of images)."""
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(2 * 9, 3))

    def loss_fn(out: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(out.mean(0, keepdim=True), y.unsqueeze(0))

    check_model(model, *data(3, 1, 5, 5), loss_fn=loss_fn, unsqueeze=False)


class Bag(nn.Module):
    """An embedding bag: token embeddings, normalized, averaged, classified."""

    def __init__(self, padding_idx=None, scale_grad_by_freq=False, tied=False) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 4, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq)
        self.norm = nn.LayerNorm(4)
        self.out = nn.Linear(4, 7)
        if tied:
            self.out.weight = self.emb.weight
        self.tied = tied

    def forward(self, idx: Tensor) -> Tensor:
        h = self.norm(self.emb(idx)).mean(-2)
        return self.out(h)


@pytest.mark.parametrize("config", [{}, {"padding_idx": 0}, {"padding_idx": -2},
                                    {"scale_grad_by_freq": True, "padding_idx": 1},
                                    {"tied": True}],
                         ids=["plain", "padding", "negative_padding", "freq", "tied_with_linear"])
def test_embedding(routing, kinds, config) -> None:
    torch.manual_seed(0)
    idx = torch.randint(0, 7, (BATCH, 6))
    idx[:, :2] = idx[:, 2:4]  # repeated indices within a sample
    idx[0, 1] = 0
    check_model(Bag(**config), idx, torch.randint(7, (BATCH,)))
    assert kinds["emb.weight"] == ("tied" if config.get("tied") else "embedding")
    assert kinds["norm.weight"] == "materialized"


def test_embedding_table_looked_up_twice(routing, kinds) -> None:
    class TwoLookups(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(5, 3)
            self.out = nn.Linear(3, 3)

        def forward(self, idx: Tensor) -> Tensor:
            return self.out(self.emb(idx).sum(-2) * self.emb(idx.flip(-1))[..., 0, :])

    check_model(TwoLookups(), torch.randint(0, 5, (BATCH, 4)), torch.randint(3, (BATCH,)))
    assert kinds["emb.weight"] == "embedding"


@pytest.mark.parametrize("norm", ["layer", "group"])
def test_norm_layers_materialized(routing, kinds, norm: str) -> None:
    """LayerNorm and GroupNorm have their rules (layer_norm.py, group_norm.py):
    per-sample affine gradients formed from the normalized input."""
    layer = nn.LayerNorm(6) if norm == "layer" else nn.GroupNorm(2, 6)
    model = nn.Sequential(nn.Linear(6, 6), layer, nn.Linear(6, 3))
    check_model(model, *data(6))
    assert kinds["1.weight"] == "materialized"
    assert kinds["1.bias"] == "bias"
    assert kinds["0.weight"] == "linear"


@pytest.mark.parametrize("groups,spatial", [(1, ()), (2, (1,)), (4, (3, 2)), (2, (3, 2))],
                         ids=["flat_one_group", "one_position", "group_per_channel", "image"])
@pytest.mark.parametrize("affine", [True, False])
def test_group_norm_shapes(routing, groups: int, spatial: Tuple[int, ...], affine: bool) -> None:
    """GroupNorm on [N, C], [N, C, 1] and images, groupings from one to one
    per channel, against the loop (torch needs more than one value a group)."""
    config = {"num_groups": groups, "num_channels": 4, "affine": affine}
    width = 4 * math.prod(spatial)
    model = nn.Sequential(nn.Linear(3, width), nn.Unflatten(1, (4, *spatial)), nn.GroupNorm(**config),
                          nn.Flatten(), nn.Linear(width, 3))
    check_model(model, *data(3))


def test_group_norm_several_images_per_sample(routing, kinds) -> None:
    """A sample of N=2 images: its per-sample gradient sums over both."""
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(16, 3))
    x, y = data(2, 2, 4, 4)
    check_model(model, x, y, lambda out, yi: F.cross_entropy(out.sum(0), yi), unsqueeze=False)
    assert kinds["1.bias"] == "bias"


def test_group_norm_takes_its_rule(routing, kinds) -> None:
    """A conv trunk's GroupNorm: its own rule, not per-sample copies."""
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(16, 3))
    check_model(model, *data(2, 4, 4))
    assert (kinds["1.weight"], kinds["1.bias"]) == ("materialized", "bias")


@pytest.mark.parametrize("config", [{"normalized_shape": (2, 3)}, {"bias": False},
                                    {"elementwise_affine": False}],
                         ids=["two_dims", "no_bias", "no_affine"])
def test_layer_norm_options(routing, config) -> None:
    shape = config.pop("normalized_shape", 6)
    layer = nn.LayerNorm(shape, **config)
    model = nn.Sequential(nn.Linear(6, 6), nn.Unflatten(-1, (2, 3)) if shape != 6 else nn.Identity(),
                          layer, nn.Flatten(-2) if shape != 6 else nn.Identity(), nn.Linear(6, 3))
    check_model(model, *data(4, 6), loss_fn=seq_loss)


class Encoder(nn.Module):
    def __init__(self, norm_first: bool = False, activation: str = "relu") -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0, batch_first=True,
                                                norm_first=norm_first, activation=activation)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor, mask: Tensor = None, causal: bool = False) -> Tensor:
        return self.head(self.layer(x, src_mask=mask, is_causal=causal).mean(-2))


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_encoder_layer(routing, kinds, norm_first: bool) -> None:
    check_model(Encoder(norm_first, "gelu"), *data(4, 8))
    assert kinds["layer.self_attn.in_proj_weight"] == "linear"
    assert kinds["layer.self_attn.out_proj.weight"] == "linear"
    assert kinds["layer.norm1.weight"] == "materialized"


@pytest.mark.parametrize("mask_kind", ["causal", "bool", "float"])
def test_attention_masks(routing, kinds, mask_kind: str) -> None:
    model = Encoder().double()
    causal_mask = nn.Transformer.generate_square_subsequent_mask(4, dtype=torch.float64)
    mask = {"causal": causal_mask, "bool": causal_mask.isinf(), "float": causal_mask}[mask_kind]
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = data(4, 8)

    def loss(p, xi, yi):
        out = functional_call(model, p, (xi.unsqueeze(0), mask, mask_kind == "causal"))
        return F.cross_entropy(out, yi.unsqueeze(0))

    assert_close_rel(batchrules.clipped_grad(loss, 0.5)(params, x, y),
                     loop_clipped_grad(loss, 0.5, (params, x, y)))
    assert kinds["layer.self_attn.in_proj_weight"] == "linear"


def test_attention_outside_the_decomposed_configuration(routing, kinds) -> None:
    """nn.MultiheadAttention returning its weights takes the generic path."""
    class Attend(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(6, 2, batch_first=True)
            self.head = nn.Linear(6, 3)

        def forward(self, x: Tensor) -> Tensor:
            out, weights = self.attn(x, x, x)
            return self.head(out.mean(-2)) + weights.sum()

    check_model(Attend(), *data(3, 6))
    assert kinds["attn.in_proj_weight"] == "materialized"


class Conv1D(nn.Module):
    """transformers' GPT-2 Conv1D: a linear with a [in, out] weight, through torch.addmm."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.5)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x: Tensor) -> Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


@pytest.mark.parametrize("rows,width", [(1, 6), (2, 16), (40, 3)],
                         ids=["one_row", "ghost", "materialized"])
def test_addmm_conv1d(routing, kinds, rows: int, width: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(width, width), nn.Tanh(), Conv1D(3, width))
    check_model(model, *data(rows, width), loss_fn=seq_loss)
    assert kinds == {"0.weight": "addmm", "0.bias": "bias", "2.weight": "addmm", "2.bias": "bias"}


def test_addmm_weight_used_twice_and_by_a_linear(routing, kinds) -> None:
    """Two addmm uses: one product over the concatenated rows; an addmm and a
    linear use of one weight: tied (test_dp_tied.py)."""
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c = Conv1D(5, 5)
            self.w = nn.Parameter(torch.randn(5, 5))

        def forward(self, x: Tensor) -> Tensor:
            h = self.c(self.c(x).tanh()).view(-1, 5)
            shared_bias = torch.ones(5, dtype=h.dtype)
            return F.linear(torch.addmm(shared_bias, h, self.w), self.w)[..., :3]

    torch.manual_seed(0)
    check_model(Twice(), *data(3, 5), loss_fn=seq_loss)
    assert kinds == {"c.weight": "addmm", "c.bias": "bias", "w": "tied"}
