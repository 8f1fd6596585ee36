"""The engine's randomness: Gaussian noise, and uniforms from the OS for secure mode.

Note [Secure mode]
``secure=True`` draws every random bit from ``os.urandom`` (the kernel's
cryptographically secure generator) instead of torch's Mersenne Twister or
Philox, whose outputs can be predicted from a few observed ones. Gaussians
come from the Box-Muller transform of 53-bit uniforms, in float64 on the CPU.
A single Gaussian sample's floating-point value leaks the uniforms it was
made from (Mironov, CCS 2012; Jin et al., arXiv:2112.05307), so each noise
element is the sum of 4 standard normals divided by 2 (std 1), as in Opacus'
secure mode, after Holohan and Braghin (arXiv:2107.10138, section 5.1,
n = 2): an attacker must then search ~2^159 candidates instead of ~2^53.
Caveats:
- Speed: 32 bytes from ``os.urandom`` per noise element, then a copy to the
  parameter's device; much slower than torch's generators on large models.
- Only the noise and the Poisson sampling are protected. Anything else that
  draws from torch's generators (dropout, initialisation, a shuffling
  loader) does not; the float64 noise is rounded to the parameter's dtype
  and the optimizer's arithmetic that follows is ordinary floating point;
  timing side channels are not addressed.
- No state to checkpoint or seed: a run in secure mode cannot be replayed,
  by design.
"""
import math
import os
from typing import Optional

import torch
from torch import Tensor

from ... import _C  # noqa: F401  (registers batchrules::gaussian_fill_)

_MANTISSA = 53  # bits of a float64 uniform
_GAUSSIAN_FILL = torch.ops.batchrules.gaussian_fill_.default


def secure_uniform(n: int) -> Tensor:
    """``n`` float64 uniforms in ``[0, 1)`` from ``os.urandom``, on the CPU:
    multiples of 2^-53, each equally likely. See Note [Secure mode]."""
    words = torch.frombuffer(bytearray(os.urandom(8 * n)), dtype=torch.int64) if n else \
        torch.zeros(0, dtype=torch.int64)
    # the top 53 bits of each word (arithmetic shift, then mask off the sign's copies)
    return ((words >> (64 - _MANTISSA)) & ((1 << _MANTISSA) - 1)).double() * 2.0 ** -_MANTISSA


def _secure_standard_normal(n: int) -> Tensor:
    """``n`` float64 standard normals from ``os.urandom`` (Box-Muller), on the CPU."""
    pairs = (n + 1) // 2
    u = secure_uniform(2 * pairs).view(2, pairs)
    radius = torch.sqrt(-2.0 * torch.log1p(-u[0]))  # 1 - u in (0, 1]: the log is finite
    angle = (2.0 * math.pi) * u[1]
    return torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])[:n]


def gaussian_noise(like: Tensor, std: float, generator: Optional[torch.Generator] = None,
                   secure: bool = False) -> Tensor:
    """Noise ``N(0, std^2)`` of ``like``'s shape, dtype and device.

    Args:
        like: the tensor whose shape, dtype and device the noise takes.
        std: the standard deviation (``noise_multiplier * max_grad_norm``);
            0 gives zeros without drawing anything.
        generator: the torch generator to draw from (None: torch's default
            one for ``like``'s device). On another device than ``like`` the
            noise is drawn there and moved, so one generator serves a model
            whose parameters are on several devices. float32 noise drawn on
            the CPU takes one 64-bit key from it and comes from Philox
            (Note [Gaussian noise from Philox] in
            csrc/dp/gaussian_noise/kernel.cpp), parallel and faster than
            ``torch.normal``; other dtypes and devices are ``torch.normal``.
        secure: draw from ``os.urandom`` with the floating-point mitigation
            of Note [Secure mode]; ``generator`` must then be None.
    """
    if secure and generator is not None:
        raise ValueError("gaussian_noise: secure noise draws from os.urandom; pass generator=None")
    if std == 0:
        return torch.zeros_like(like)
    if secure:
        total = _secure_standard_normal(4 * like.numel()).view(4, -1).sum(0) / 2
        return (total * std).view(like.shape).to(device=like.device, dtype=like.dtype)
    device = like.device if generator is None else generator.device
    if _philox_serves(like, device):
        noise = torch.empty(like.shape)
        _GAUSSIAN_FILL(noise, _philox_key(generator), float(std))
    else:
        noise = torch.normal(0.0, float(std), like.shape, generator=generator, dtype=like.dtype,
                             device=device)
    return noise.to(like.device)


def add_gaussian_noise_(x: Tensor, std: float, generator: Optional[torch.Generator] = None,
                        secure: bool = False) -> Tensor:
    """``x += gaussian_noise(x, std, generator, secure)``, in place; returns
    ``x``. A contiguous float32 CPU tensor (not a subclass) takes the noise
    from Philox without a noise tensor: one pass over ``x``."""
    device = x.device if generator is None else generator.device
    if (std != 0 and not secure and _philox_serves(x, device) and x.device.type == "cpu"
            and type(x) is Tensor and x.is_contiguous()):
        _GAUSSIAN_FILL(x, _philox_key(generator), float(std), accumulate=True)
        return x
    return x.add_(gaussian_noise(x, std, generator, secure))


def _philox_serves(like: Tensor, device: torch.device) -> bool:
    """Whether noise like ``like`` drawn on ``device`` comes from
    batchrules::gaussian_fill_: float32 on the CPU, eager."""
    return device.type == "cpu" and like.dtype == torch.float32 and not torch.compiler.is_compiling()


def _philox_key(generator: Optional[torch.Generator]) -> int:
    """One draw of the generator (torch's default CPU one for None): the
    Philox key of one noise tensor (Note [Gaussian noise from Philox])."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
