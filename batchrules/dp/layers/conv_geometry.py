"""How a convolution's arguments meet its input: explicit padding, and the
one tap that reads a one-pixel input (conv.py).

Note [A convolution over one pixel]
A padded convolution of a 1x1 input to a 1x1 output (a ResNet's last stage
on 32x32 images: 3x3, padding 1) reads its input through one tap, the one
landing on the pixel; the others read padding. The rule's forward then is
``F.linear`` of the pixel with that tap's ``[O, C]`` slice of the weight,
exactly the convolution's sum without its zero terms, and autograd's input
gradient one GEMM too: oneDNN runs the whole kernel over the padding, many
times the GEMM and the one copy of the tap's strided slice. The recorded use
is the convolution's, its output gradient viewed back to ``[B, O, 1, 1]``:
norms and clipped sum as for any convolution.
"""
from typing import Any, Optional, Tuple


def ints(value: Any, dims: int) -> Optional[Tuple[int, ...]]:
    """An int or a sequence of ints as ``dims`` ints, or None."""
    values = tuple(value) if isinstance(value, (tuple, list)) else (value,) * dims
    if len(values) == 1:
        values = values * dims
    return values if len(values) == dims and all(type(v) is int for v in values) else None


def explicit_padding(padding: Any, kernel: Tuple[int, ...], stride: Tuple[int, ...],
                     dilation: Tuple[int, ...]) -> Optional[Tuple[int, ...]]:
    """Explicit symmetric padding, or None for what F.unfold cannot express."""
    if padding == "valid":
        return (0,) * len(kernel)
    if padding == "same":
        totals = [d * (k - 1) for k, d in zip(kernel, dilation)]
        if any(s != 1 for s in stride) or any(t % 2 for t in totals):
            return None  # asymmetric (or invalid): the generic path handles it
        return tuple(t // 2 for t in totals)
    return ints(padding, len(kernel))


def pixel_tap(spatial: Tuple[int, ...], kernel: Tuple[int, ...], stride: Tuple[int, ...],
              padding: Tuple[int, ...], dilation: Tuple[int, ...]) -> Optional[Tuple[int, ...]]:
    """The one kernel tap that reads a 1x1 input into a 1x1 output, or None
    (Note [A convolution over one pixel])."""
    taps = []
    for n, k, s, p, d in zip(spatial, kernel, stride, padding, dilation):
        # the output is 1 wide: 0 <= 2p - d(k-1) < s; the tap at the pixel: j d = p
        if n != 1 or not 0 <= 2 * p - d * (k - 1) < s or p % d or p // d >= k:
            return None
        taps.append(p // d)
    return tuple(taps)
