"""Differences between the torch releases batchrules supports, in one place.

Each function here wraps one internal of torch whose location or behaviour
changed between releases; callers never reach into those internals directly.
"""
import contextlib
from typing import Callable, ContextManager, Dict, Iterator, Optional, Sequence, Tuple

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


@contextlib.contextmanager
def reparametrized(modules: Sequence[torch.nn.Module],
                   states: Sequence[Dict[str, Tensor]]) -> Iterator[None]:
    """Each module with its parameters and buffers replaced by its state's
    tensors (by name), as ``torch.func.functional_call`` does, for the block.
    Tied names are each in the state (with one tensor), hence no tying."""
    from torch.nn.utils.stateless import _reparametrize_module

    with contextlib.ExitStack() as stack:
        for module, state in zip(modules, states):
            stack.enter_context(_reparametrize_module(module, state, tie_weights=False))
        yield


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


def unwrap_batched(tensor: Tensor, level: int) -> Tuple[Tensor, int]:
    """``(physical tensor, batch dim)`` of a tensor batched at ``level``
    (``batched_level(tensor) == level``)."""
    value, bdim = torch._C._functorch._unwrap_batched(tensor, level)
    assert bdim is not None, "unwrap_batched: not batched at this level"
    return value, bdim


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


@contextlib.contextmanager
def vmap_level(batch_size: int, randomness: str) -> Iterator[int]:
    """Enters a vmap level of ``batch_size`` (as ``torch.func.vmap`` does inside),
    yielding it; for the engine's per-call vmap (Note [A batched forward, one
    vmap per call] in batchrules/dp/batched_forward.py)."""
    functorch = torch._C._functorch
    level = functorch._vmap_increment_nesting(batch_size, randomness)
    try:
        yield level
    finally:
        functorch._vmap_decrement_nesting()


def remove_batch_dim(tensor: Tensor, level: int, batch_size: int) -> Tensor:
    """The physical ``[B, ...]`` tensor of a tensor batched at ``level``."""
    return torch._C._functorch._remove_batch_dim(tensor, level, batch_size, 0)


def version_counter(tensor: Tensor) -> int:
    """The tensor's in-place modification counter (shared with its views)."""
    return tensor._version


def is_view(tensor: Tensor) -> bool:
    """Whether autograd tracks ``tensor`` as a view of another tensor."""
    return tensor._is_view()


# Note [clipped_grad's vmap over plain tensors]
# torch.func.vmap's Python wrapper flattens and broadcasts its arguments and
# in_dims as pytrees and unflattens its outputs (cProfile: mostly
# torch.utils._pytree), a fixed cost clipped_grad would add to every DP step,
# several times what entering the level directly costs. Where every vmapped
# argument is a tensor with an int or None
# dim and the function returns a tensor, clipped_grad enters the vmap level
# itself through the primitives torch.func.vmap uses; anything else takes
# torch.func.vmap.
_RANDOMNESS = ("error", "different", "same")


def vmap_over_tensors(fn: Callable[..., Tensor], args: Sequence[Tensor],
                      in_dims: Sequence[Optional[int]], randomness: str) -> Tensor:
    """``torch.func.vmap(fn, in_dims, randomness=randomness)(*args)`` for tensor
    ``args`` (at least one batched, at an int dim) and a tensor output (batched
    at dim 0). See Note [clipped_grad's vmap over plain tensors]."""
    if randomness not in _RANDOMNESS:
        raise RuntimeError(f"Only allowed values for randomness are 'error', 'different', or "
                           f"'same'. Got {randomness}")
    sizes = []
    for arg, dim in zip(args, in_dims):
        if dim is not None:
            if not -arg.dim() <= dim < arg.dim():
                raise ValueError(f"vmap: in_dims {dim} is out of range for a tensor of "
                                 f"{arg.dim()} dimensions (shape {tuple(arg.shape)})")
            sizes.append(arg.shape[dim])
    if not sizes:
        raise ValueError("vmap: at least one argument must be batched (an int in_dims), "
                         f"got in_dims {tuple(in_dims)}")
    if any(size != sizes[0] for size in sizes[1:]):  # no set(): sizes may be SymInts
        raise ValueError(f"vmap: expected all tensors to have the same size in the mapped "
                         f"dimension, got sizes {sizes} for the mapped dimension")
    functorch = torch._C._functorch
    with torch.autograd.graph.disable_saved_tensors_hooks(
            "torch.func transforms don't yet support saved tensor hooks"):
        level = functorch._vmap_increment_nesting(sizes[0], randomness)
        try:
            out = fn(*(arg if dim is None else functorch._add_batch_dim(arg, dim % arg.dim(), level)
                       for arg, dim in zip(args, in_dims)))
            if not isinstance(out, Tensor):
                raise TypeError(f"vmap: the function must return a tensor, got "
                                f"{type(out).__name__}")
            return functorch._remove_batch_dim(out, level, sizes[0], 0)
        finally:
            functorch._vmap_decrement_nesting()
