"""clipped_grad's arguments: their checks, the differentiated positions, the
batched dims, and the batch along them before vmap sees it."""
import math
import numbers
from typing import Any, Callable, List, Optional, Tuple, Union

from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

ArgNums = Union[int, Tuple[int, ...]]


def check_max_norm(max_norm: Any) -> None:
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) \
            or not math.isfinite(max_norm) or max_norm <= 0:
        raise ValueError(f"clipped_grad: max_norm must be a finite number > 0, got {max_norm!r}")


def check_argnums(argnums: Any) -> None:
    if isinstance(argnums, bool) or not isinstance(argnums, (int, tuple)) or (
            isinstance(argnums, tuple) and (not argnums or not all(
                isinstance(a, int) and not isinstance(a, bool) for a in argnums))):
        raise TypeError(f"clipped_grad: argnums must be an int or a non-empty tuple of ints, "
                        f"got {argnums!r}")
    if isinstance(argnums, tuple) and len(set(argnums)) != len(argnums):
        raise ValueError(f"clipped_grad: argnums must not repeat, got {argnums}")


def positions_of(argnums: ArgNums, n_args: int) -> Tuple[int, ...]:
    """The differentiated arguments' positions, each in ``range(n_args)``."""
    positions = []
    for a in argnums if isinstance(argnums, tuple) else (argnums,):
        if not -n_args <= a < n_args:
            raise ValueError(f"clipped_grad: argnums {argnums} out of range for {n_args} "
                             "positional arguments")
        positions.append(a % n_args)
    if len(set(positions)) != len(positions):
        raise ValueError(f"clipped_grad: argnums {argnums} name an argument twice")
    return tuple(positions)


def dims_per_argument(in_dims: Any, positions: Tuple[int, ...], n_args: int) -> Tuple[Any, ...]:
    """vmap's in_dims, one entry per argument (None for the differentiated ones)."""
    if in_dims is None:
        return tuple(None if i in positions else 0 for i in range(n_args))
    dims = (in_dims,) * n_args if isinstance(in_dims, int) else in_dims
    if not isinstance(dims, tuple) or len(dims) != n_args:
        raise ValueError(f"clipped_grad: in_dims must be an int or a tuple with one entry per "
                         f"positional argument ({n_args}), got {in_dims!r}")
    for i in positions:
        if any(d is not None for d in tree_flatten(dims[i])[0]):
            raise ValueError(
                f"clipped_grad: argument {i} is differentiated (argnums) and must be unbatched, "
                f"but in_dims gives it {dims[i]!r}: its per-sample gradients are what clipped_grad "
                f"avoids forming. Use None there (e.g. in_dims=(None, 0, 0)), or omit in_dims")
    return dims


def map_batched(fn: Callable[[Tensor, int], Any], arg: Any, dims: Any) -> Any:
    """``arg`` with ``fn(t, dim)`` applied to each tensor batched along ``dim``
    (``dims`` as vmap's in_dims for one argument: an int, None, or a prefix
    pytree of them)."""
    def one(d: Optional[int], sub: Any) -> Any:
        return sub if d is None else tree_map(lambda t: fn(t, d), sub)

    if dims is None or isinstance(dims, int):
        return one(dims, arg)
    return tree_map(one, dims, arg, is_leaf=lambda x: x is None)


def batch_sizes(args: Tuple[Any, ...], dims: Tuple[Any, ...]) -> List[int]:
    """Each batched tensor's size along its dim, in argument order."""
    sizes: List[int] = []
    for arg, d in zip(args, dims):
        map_batched(lambda t, dim: sizes.append(t.shape[dim]), arg, d)
    return sizes


def is_empty_batch(args: Tuple[Any, ...], dims: Tuple[Any, ...]) -> bool:
    """Whether every batched leaf is a tensor with no samples along its dim
    (inputs vmap would reject are left to vmap, which names why)."""
    sizes: List[int] = []
    for arg, d in zip(args, dims):
        if isinstance(arg, Tensor) and isinstance(d, int):  # most calls: no pytree walk
            if not -arg.dim() <= d < arg.dim():
                return False
            sizes.append(arg.shape[d])
        elif d is not None:
            try:
                sizes += batch_sizes((arg,), (d,))
            except (AttributeError, IndexError, TypeError, ValueError):  # a non-tensor, a dim out of range
                return False
    return bool(sizes) and not any(sizes)
