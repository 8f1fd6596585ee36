"""The activation ops under test, their stock counterparts and sample shapes."""
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

import batchrules

Shape = Tuple[int, ...]


@dataclass(frozen=True)
class Act:
    name: str
    op: Callable[[Tensor], Tensor]
    backward: Callable[[Tensor, Tensor], Tensor]
    stock: Callable[[Tensor], Tensor]                   # F.silu: differentiable to any order
    stock_backward: Callable[[Tensor, Tensor], Tensor]  # aten's one-kernel backward
    module: Callable[[], torch.nn.Module]
    complex_forward: bool

    def __repr__(self) -> str:
        return self.name


ACTS = [
    Act("silu", batchrules.silu, batchrules.silu_backward, F.silu,
        torch.ops.aten.silu_backward.default, torch.nn.SiLU, complex_forward=True),
    Act("mish", batchrules.mish, batchrules.mish_backward, F.mish,
        torch.ops.aten.mish_backward.default, torch.nn.Mish, complex_forward=False),
]

# Per-example shapes, pairwise distinct sizes so a wrong broadcast cannot pass.
SHAPES: List[Shape] = [(), (0,), (5,), (2, 3), (2, 3, 4)]

# (grad_output, self) shapes that broadcast, each kind once.
BACKWARD_SHAPES: List[Tuple[Shape, Shape]] = [
    ((2, 3), (2, 3)),
    ((2, 3), (3,)),       # self broadcast
    ((3,), (2, 3)),       # grad_output broadcast
    ((2, 1), (1, 3)),     # both broadcast
    ((), (2, 3)),
    ((4,), ()),
    ((0, 3), (3,)),       # empty
]


def sample(shape: Shape, dtype: torch.dtype = torch.float64, requires_grad: bool = False,
           seed: int = 0, layout: Optional[str] = None) -> Tensor:
    """A deterministic random tensor with values in about [-4, 4] (both tails of the
    activations), contiguous or "transposed" (all strides reversed)."""
    gen = torch.Generator().manual_seed(seed)
    t = 3 * torch.randn(shape, dtype=torch.float64, generator=gen)
    if layout == "transposed" and t.dim() > 1:
        perm = list(reversed(range(t.dim())))
        t = t.permute(perm).contiguous().permute(perm)
    return t.to(dtype).requires_grad_(requires_grad)
