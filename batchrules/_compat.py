"""Differences between the torch releases batchrules supports, in one place.

Each function here wraps one internal of torch whose location or behaviour
changed between releases; callers never reach into those internals directly.
"""
from typing import ContextManager, Optional, Tuple

import torch
from torch import Tensor


def load_functorch_vmap_decompositions() -> None:
    """Have functorch register its Python vmap decompositions now.

    functorch registers them on ``FuncTorchBatched`` at the first vmap call, and
    the newest registration of a kernel wins; batchrules' routed batching rules
    for the same aten ops must come after them (Note [Routing aten ops only
    while transforms are active]).
    """
    from torch._functorch.vmap import lazy_load_decompositions

    lazy_load_decompositions()


def dispatch_has_kernel(qualified_name: str, dispatch_key: str) -> bool:
    """Whether ``qualified_name`` (``"aten::op"``) has a kernel of its own for
    ``dispatch_key`` (a fallback does not count): e.g. whether functorch has a
    batching rule (``"FuncTorchBatched"``)."""
    import torch

    return torch._C._dispatch_has_kernel_for_dispatch_key(qualified_name, dispatch_key)
# ---- vmap internals used by batchrules.dp (see Note [Forward under vmap, backward
# outside it] in batchrules/dp/transform.py) ------------------------------------

def current_transform_level() -> Optional[int]:
    """The level of the innermost active functorch transform, None outside all."""
    return torch._C._functorch.maybe_current_level()


def batched_level(tensor: Tensor) -> int:
    """The level of the outermost functorch wrapper of ``tensor``; -1 for a plain tensor."""
    return torch._C._functorch.maybe_get_level(tensor)


def unwrap_batched(tensor: Tensor, level: int) -> Tuple[Tensor, Optional[int]]:
    """``(physical tensor, batch dim)`` of a tensor batched at ``level``;
    ``(tensor, None)`` when it is not batched at that level."""
    return torch._C._functorch._unwrap_batched(tensor, level)


def add_batch_dim(tensor: Tensor, batch_dim: int, level: int) -> Tensor:
    """A tensor batched at ``level`` over dim ``batch_dim`` of the physical ``tensor``."""
    return torch._C._functorch._add_batch_dim(tensor, batch_dim, level)


def allow_requires_grad() -> ContextManager[None]:
    """Lets ``requires_grad_()`` run inside a functorch transform. functorch
    forbids it there (it would be wrong under grad); clipped_grad only calls
    it on plain physical tensors under its own vmap."""
    from torch._functorch.eager_transforms import enable_inplace_requires_grad

    return enable_inplace_requires_grad(True)


def only_vmaps_above(level: int) -> bool:
    """Whether every functorch transform active above ``level`` is a vmap."""
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return all(i.key() == TransformType.Vmap for i in retrieve_all_functorch_interpreters()
               if i.level() > level)


def version_counter(tensor: Tensor) -> int:
    """The tensor's in-place modification counter (shared with its views)."""
    return tensor._version


def is_view(tensor: Tensor) -> bool:
    """Whether autograd tracks ``tensor`` as a view of another tensor."""
    return tensor._is_view()
