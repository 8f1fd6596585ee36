"""Logical batches: one DP-SGD step over any number of samples, in chunks that fit memory.

DP-SGD wants large batches (the noise std is divided by the batch size) but
the memory of a step grows with the samples in it. Per-sample clipping makes
the step separable: the clipped sum of a batch is the sum of its chunks'
clipped sums, exactly (each sample is clipped by its own norm), so a logical
batch runs as chunks of ``chunk_size`` samples, one ``clipped_grad`` each,
and only the running sum (one tensor per parameter) outlives a chunk. Noise
is then added once, to the logical batch's sum, by the caller.
"""
from typing import Any, Callable, List, Tuple

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from .arguments import ArgNums, batch_sizes, dims_per_argument, map_batched, positions_of
from .transform import clipped_grad


def clipped_grad_chunked(loss: Callable[..., Any], max_norm: float, chunk_size: int, *,
                         in_dims: Any = None, argnums: ArgNums = 0, has_aux: bool = False,
                         randomness: str = "error") -> Callable[..., Any]:
    """``clipped_grad`` over a logical batch, ``chunk_size`` samples at a time.

    Takes and returns what ``clipped_grad(loss, max_norm, in_dims=...,
    argnums=..., has_aux=..., randomness=...)`` does: ``(clipped_sum, norms)``
    for the whole batch, ``norms`` in sample order (and ``aux`` concatenated
    along dim 0 with ``has_aux``), equal to one call up to the order of the
    floating-point additions; its peak memory is one chunk's plus the running
    sum. Any batch size works, 0 (an empty Poisson batch: zero sums, norms of
    shape ``[0]``) included. With ``randomness="different"`` every chunk
    draws its own randomness, as separate calls would.

    Example (Poisson-sampled logical batch ``idx``, noise once per step)::

        step = clipped_grad_chunked(loss, C, chunk_size=256)
        sums, norms = step(params, x[idx], y[idx])
        grads = {k: (s + sigma * C * torch.randn_like(s)) / (q * N) for k, s in sums.items()}
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"clipped_grad_chunked: chunk_size must be an int >= 1, got {chunk_size!r}")
    clipped = clipped_grad(loss, max_norm, in_dims=in_dims, argnums=argnums, has_aux=has_aux,
                           randomness=randomness)

    def chunked(*args: Any) -> Any:
        dims = dims_per_argument(in_dims, positions_of(argnums, len(args)), len(args))
        batch = _batch_size(args, dims)
        total: Any = None
        norms: List[Tensor] = []
        auxes: List[Any] = []
        for start in range(0, max(batch, 1), chunk_size):  # one (empty) chunk for batch 0
            length = min(chunk_size, batch - start)
            out = clipped(*(_narrow(a, d, start, length) for a, d in zip(args, dims)))
            (sums, chunk_norms), aux = out if has_aux else (out, None)
            # in place: the chunk's sums are fresh tensors; dropped before the
            # next chunk runs, so only the running sum outlives a chunk
            total = sums if total is None else tree_map(Tensor.add_, total, sums)
            del out, sums
            norms.append(chunk_norms)
            auxes.append(aux)
        result = (total, torch.cat(norms))
        if not has_aux:
            return result
        return result, tree_map(lambda *parts: torch.cat(parts)
                                if isinstance(parts[0], Tensor) else parts[0], *auxes)

    return chunked


def _batch_size(args: Tuple[Any, ...], dims: Tuple[Any, ...]) -> int:
    sizes = batch_sizes(args, dims)
    if not sizes:
        raise ValueError("clipped_grad_chunked: no argument is batched (in_dims)")
    return sizes[0]


def _narrow(arg: Any, dims: Any, start: int, length: int) -> Any:
    """Samples ``start:start + length`` of ``arg``, batched along ``dims``."""
    return map_batched(lambda t, dim: t.narrow(dim, start, length), arg, dims)
