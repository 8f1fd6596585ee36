"""Note [A convolution over one pixel] (batchrules/dp/layers/conv_geometry.py):
a convolution of a 1x1 input to a 1x1 output runs as F.linear with the one tap
that reads the pixel; clipped_grad stays exact against the per-sample loop."""
import itertools
from typing import Dict, List

import pytest
import torch
import torch.nn.functional as F
from dp_reference import assert_close_rel, loop_clipped_grad
from torch import Tensor, nn
from torch.func import functional_call

import batchrules
from batchrules.dp.layers import conv as conv_rule
from batchrules.dp.layers.conv_geometry import pixel_tap

BATCH = 5


@pytest.fixture
def conv_calls(monkeypatch) -> List[int]:
    """The dims of every convolution the rule ran as a convolution."""
    calls: List[int] = []
    for dims, conv in list(conv_rule._CONV.items()):
        monkeypatch.setitem(conv_rule._CONV, dims,
                            lambda *a, _c=conv, _d=dims, **k: calls.append(_d) or _c(*a, **k))
    return calls


def test_pixel_tap_is_the_only_tap_that_reads_the_pixel() -> None:
    """Against the convolution itself: where pixel_tap names a tap, the 1-wide
    output equals that tap's product; where it does not, the output is wider
    or reads only padding."""
    for k, s, p, d in itertools.product(range(1, 6), range(1, 4), range(0, 5), range(1, 3)):
        if 1 + 2 * p - d * (k - 1) < 1:
            continue  # no output at all
        x = torch.randn(2, 3, 1, dtype=torch.float64)
        w = torch.randn(4, 3, k, dtype=torch.float64)
        out = F.conv1d(x, w, stride=s, padding=p, dilation=d)
        tap = pixel_tap((1,), (k,), (s,), (p,), (d,))
        if tap is None:  # wider, or 1 wide reading only padding (then the output is 0)
            assert out.shape[-1] != 1 or torch.count_nonzero(out) == 0, (k, s, p, d)
            continue
        assert out.shape[-1] == 1, (k, s, p, d)
        torch.testing.assert_close(out[..., 0], x[..., 0] @ w[..., tap[0]].t())
    assert pixel_tap((1, 2), (3, 3), (1, 1), (1, 1), (1, 1)) is None  # not one pixel


def check(model: nn.Module, x: Tensor, y: Tensor, unsqueeze: bool = True) -> None:
    model = model.double()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p: Dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        if unsqueeze:
            xi = xi.unsqueeze(0)
        out = functional_call(model, p, (xi,))
        return F.cross_entropy(out.reshape(-1, out.shape[-1]).mean(0, keepdim=True), yi.unsqueeze(0))

    want = loop_clipped_grad(loss, 0.5, (params, x, y))
    got = batchrules.clipped_grad(loss, 0.5)(params, x, y)
    assert_close_rel(got, want)
    assert (want[1] > 0.5).any(), "the test must clip some samples"


CONFIGS = {  # conv kwargs on a 1x1 input; each keeps a 1x1 output
    "3x3_pad1": dict(kernel_size=3, padding=1),
    "3x3_pad1_stride2": dict(kernel_size=3, padding=1, stride=2),
    "5x5_pad2_no_bias": dict(kernel_size=5, padding=2, bias=False),
    "3x3_pad2_dilation2": dict(kernel_size=3, padding=2, dilation=2),
    "1x1": dict(kernel_size=1),
    "3x1_pad_1_0": dict(kernel_size=(3, 1), padding=(1, 0)),
    "same": dict(kernel_size=3, padding="same"),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_one_pixel_conv2d_takes_the_linear(routing, conv_calls, name) -> None:
    """First layer (data input: the output needs its own node) and a second
    layer on a differentiated input, against the per-sample loop in float64."""
    kw = CONFIGS[name]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, **kw), nn.ReLU(), nn.Conv2d(6, 4, **kw), nn.Flatten(),
                          nn.Linear(4, 3))
    x = torch.randn(BATCH, 3, 1, 1, dtype=torch.float64)
    check(model, x, torch.randint(3, (BATCH,)))
    assert conv_calls == []


def test_one_pixel_conv1d_and_several_images(routing, conv_calls) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(3, 5, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(5, 3))
    check(model, torch.randn(BATCH, 3, 1, dtype=torch.float64), torch.randint(3, (BATCH,)))
    # a sample is 4 one-pixel images: [B, N, C, 1, 1], per-sample [N, C, 1, 1]
    model = nn.Sequential(nn.Conv2d(2, 5, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(5, 3))
    check(model, torch.randn(BATCH, 4, 2, 1, 1, dtype=torch.float64), torch.randint(3, (BATCH,)),
          unsqueeze=False)
    assert conv_calls == []


def test_other_geometries_stay_convolutions(routing, conv_calls) -> None:
    """A 1x1 input padded to a wider output, a 2x2 input, and groups: the convolution."""
    torch.manual_seed(0)
    for conv, shape in [(nn.Conv2d(3, 4, 3, padding=2), (3, 1, 1)),
                        (nn.Conv2d(3, 4, 3, padding=1, stride=2), (3, 2, 2)),
                        (nn.Conv2d(4, 4, 3, padding=1, groups=2), (4, 1, 1))]:
        out = conv(torch.zeros(1, *shape)).shape[1:].numel()
        model = nn.Sequential(conv, nn.Flatten(), nn.Linear(out, 3))
        check(model, torch.randn(BATCH, *shape, dtype=torch.float64), torch.randint(3, (BATCH,)))
    assert conv_calls == [2, 2, 2]
