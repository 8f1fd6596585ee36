"""clipped_grad on code vmap(grad) runs, with gradients of any layout:
non-contiguous and stride-0 output gradients, torch.Size arguments beside
parameters, per-sample inputs with several leading dims; against the per-sample
loop in float64. Also: routing inside clipped_grad, and the calls it refuses.
"""
from typing import Any, Callable, Dict, Tuple

import pytest
import torch
import torch.nn.functional as F
from dp_reference import assert_close_rel, loop_clipped_grad
from torch import Tensor, nn
from torch.func import functional_call

import batchrules

BATCH = 4


def check(loss: Callable[..., Tensor], *args: Any, max_norm: float = 0.1, **kw: Any) -> None:
    want = loop_clipped_grad(loss, max_norm, args, **kw)
    got = batchrules.clipped_grad(loss, max_norm, **kw)(*args)
    assert_close_rel(got, want)


def module_loss(model: nn.Module, out: Callable[[Tensor], Tensor] = lambda o: o.sum(),
                unsqueeze: bool = True) -> Tuple[Callable[..., Tensor], Dict[str, Tensor]]:
    """``out(model(x_i))`` per sample, and the model's parameters to differentiate."""
    model = model.double()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p: Dict[str, Tensor], xi: Tensor) -> Tensor:
        return out(functional_call(model, p, (xi.unsqueeze(0) if unsqueeze else xi,)))

    return loss, params


def check_module(model: nn.Module, x: Tensor, *args: Any, **kw: Any) -> None:
    loss, params = module_loss(model, *args, **kw)
    check(loss, params, x)


def randn(*shape: int) -> Tensor:
    torch.manual_seed(0)
    return torch.randn(BATCH, *shape, dtype=torch.float64)


class PatchEmbed(nn.Module):
    """timm's ViT stem: conv patches -> flatten(2).transpose(1, 2) -> cat with a class token."""

    def __init__(self, groups: int = 1, dims: int = 2) -> None:
        super().__init__()
        conv = nn.Conv2d if dims == 2 else nn.Conv1d
        self.conv = conv(4, 8, 4, stride=4, groups=groups)
        self.cls = nn.Parameter(torch.randn(1, 1, 8))
        self.fc = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        t = self.conv(x).flatten(2).transpose(1, 2)
        return self.fc(torch.cat([self.cls.expand(t.shape[0], -1, -1), t], 1))


def test_vit_patch_embedding_repro() -> None:
    model = PatchEmbed()
    model.conv = nn.Conv2d(3, 64, 8, stride=8)
    model.cls, model.fc = nn.Parameter(torch.randn(1, 1, 64)), nn.Linear(64, 3)
    check_module(model, randn(3, 32, 32), lambda o: o.pow(2).mean())


@pytest.mark.parametrize("dims", [1, 2])
@pytest.mark.parametrize("groups", [1, 2, 4], ids=["dense", "grouped", "depthwise"])
@pytest.mark.parametrize("images", [0, 3], ids=["one_image", "three_images"])
def test_conv_transposed_output_gradient(dims: int, groups: int, images: int) -> None:
    """Ghost, materialized (grouped kernel) and kept paths all see the transposed gradient."""
    spatial = (8, 8) if dims == 2 else (16,)
    x = randn(*((images,) if images else ()), 4, *spatial)
    check_module(PatchEmbed(groups, dims), x, lambda o: o.pow(2).mean(), unsqueeze=not images)


@pytest.mark.parametrize("channels", [(4, 2), (2, 6)], ids=["scale_g", "scale_x"])
def test_conv_output_summed_directly(channels) -> None:
    """The output gradient is a stride-0 expansion: never scaled in place."""
    check_module(nn.Conv1d(*channels, 3), randn(channels[0], 9))


def test_linear_and_addmm_outputs_summed_directly() -> None:
    def loss(p: Dict[str, Tensor], x: Tensor) -> Tensor:
        return F.linear(x, p["w"], p["b"]).sum() + torch.addmm(p["c"], x, p["v"]).sum()

    torch.manual_seed(0)
    p = {k: torch.randn(*s, dtype=torch.float64) for k, s in
         {"w": (3, 5), "b": (3,), "v": (5, 2), "c": (2,)}.items()}
    check(loss, p, randn(2, 5))


def test_torch_size_beside_a_parameter() -> None:
    """Calls without a rule taking a parameter and a torch.Size."""
    def loss(p: Dict[str, Tensor], x: Tensor, frozen_b: Tensor) -> Tensor:
        w = p["w"]
        h = F.linear(x, w.view(w.shape)) + w.new_zeros(w.shape).sum()
        return F.layer_norm(h, h.shape[-1:], p["g"], frozen_b).pow(2).sum()

    torch.manual_seed(0)
    p = {"w": torch.randn(4, 5, dtype=torch.float64), "g": torch.randn(4, dtype=torch.float64)}
    check(loss, p, randn(5), torch.randn(4, dtype=torch.float64), in_dims=(None, 0, None))


def test_pre_norm_transformer_on_several_sequences() -> None:
    """A per-sample [N, T, E]: the LayerNorms' gradients arrive non-contiguous."""
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, norm_first=True)
    check_module(layer, randn(2, 3, 8), lambda o: o.pow(2).sum(), unsqueeze=False)


@pytest.mark.parametrize("images", [1, 2])
def test_channels_last_conv_then_group_norm(images: int) -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.Flatten(-3), nn.Linear(16, 3))
    model = model.double().to(memory_format=torch.channels_last)
    x = randn(images, 3, 4, 4)
    x = x.flatten(0, 1).contiguous(memory_format=torch.channels_last).view(x.shape)
    check_module(model, x, lambda o: o.pow(2).sum(), unsqueeze=False)


def test_conv1d_on_a_transposed_length_one_input() -> None:
    model = nn.Sequential(nn.Conv1d(5, 4, 1), nn.Flatten(-2), nn.Linear(4, 3))
    check_module(model, randn(1, 5).transpose(1, 2), lambda o: o.pow(2).sum())


def test_conv_on_a_zero_length_input_raises_eagers_error() -> None:
    """Its physical input is folded with every size named (a ``-1`` is
    ambiguous for no elements): the convolution itself reports the input."""
    loss, params = module_loss(nn.Sequential(nn.Conv1d(5, 4, 1), nn.Flatten(-2), nn.Linear(4, 3)))
    x, error = randn(5, 0), "Calculated padded input size per channel: \\(0\\)"
    with pytest.raises(RuntimeError, match=error):  # eager, one sample
        loss(params, x[0])
    with pytest.raises(RuntimeError, match=error):
        batchrules.clipped_grad(loss, 0.1)(params, x)


@pytest.mark.parametrize("user_state", [False, True], ids=["routing_off", "routing_on"])
def test_routing_on_inside_and_restored(user_state: bool) -> None:
    seen = []

    def loss(w: Tensor, x: Tensor) -> Tensor:
        seen.append(batchrules.is_enabled())
        return F.scaled_dot_product_attention(x @ w, x, x).sum()

    def failing(w: Tensor, x: Tensor) -> Tensor:
        raise ValueError("inside the loss")

    w, x = torch.randn(4, 4, dtype=torch.float64), randn(3, 4)
    with batchrules.enabled(user_state):
        check(loss, w, x)
        assert seen[-1] and batchrules.is_enabled() is user_state  # the last: clipped_grad's
        with pytest.raises(ValueError, match="inside the loss"):
            batchrules.clipped_grad(failing, 1.0)(w, x)
        assert batchrules.is_enabled() is user_state


@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm_in_training_mode_is_refused(affine: bool) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, affine=affine)).double()
    stats = [model[1].running_mean.clone(), model[1].running_var.clone()]
    # Without affine parameters clipped_grad never sees the call (Note [Intercepting
    # only the calls that take a parameter]): torch's own check refuses it, as under vmap(grad).
    error, match = (RuntimeError, r"BatchNorm in training mode.*argument 0\['1.weight'\]") \
        if affine else (ValueError, r"more than 1 value per channel when training")
    loss, params = module_loss(model)
    with pytest.raises(error, match=match):
        batchrules.clipped_grad(loss, 1.0)(params, randn(3))
    assert torch.equal(model[1].running_mean, stats[0])
    assert torch.equal(model[1].running_var, stats[1])
    check_module(model.eval(), randn(3))
