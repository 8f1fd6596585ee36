"""The Gaussian noise of DP-SGD."""
from typing import Optional

import torch
from torch import Tensor


def gaussian_noise(like: Tensor, std: float, generator: Optional[torch.Generator],
                   secure: bool) -> Tensor:
    """``N(0, std^2)`` noise of ``like``'s shape, dtype and device."""
    if secure:
        raise NotImplementedError("batchrules.dp: secure noise")
    return torch.normal(0.0, std, like.shape, generator=generator, dtype=like.dtype,
                        device=like.device)
