"""The engine's forward: the model on its physical batch, the calls that take a
parameter split per sample.

Note [A batched forward, one vmap per call]
The engine (engine/) runs the user's model on its physical batch without
vmap: sample i is row i of dim 0 (as Opacus' hooks assume), and every call
that takes no parameter runs as written (a 2-D attention mask's ``.all()``,
``.item()``, data-dependent branches). A call that takes a differentiated
leaf (Note [Intercepting only the calls that take a parameter]) runs under
a vmap of its own over the batch, where it takes the path it takes under
clipped_grad's vmap: its rule, or per-sample copies of its parameters. Each
tensor argument is read by its shape:

- dim 0 of the batch's size B: sample i's piece is row i with dim 0 kept
  (``[1, ...]``, a batch of one), so that the call's dims keep their meaning;
- dim 0 of size k*B (the rows of a flattened batch-first tensor, as
  ``x.view(-1, I)`` before an addmm; k = 0 for zero-length sequences):
  sample i's piece is its k rows;
- dim 0 of size 1: shared by the samples (broadcast over the batch);
- anything else, or a call with no argument of the batch: the call cannot be
  split; it runs on the leaves themselves, and the gradient that reaches a
  leaf is reported after the backward.

The results come back as rows of the batch (a shared argument's call thus
gives B rows where it gave one: what broadcasting would make of it). A rule
whose function holds the batch elsewhere (a recurrent layer's states,
attention's sequence-first inputs) says where (``Rule.batch_dims``). Shapes
can mislead (a tensor whose dim 0 happens to be B); the engine's first-step
validation compares the result with samples run one at a time.

Note [A rule on the plain batch]
Under the per-call vmap a rule unwraps its BatchedTensors to the physical
batch-first tensors and wraps its physical result again: a level, a wrap per
argument and a pytree walk each way, for an op that works on the physical
batch anyway. A rule that can read the engine's plain tensors directly
(``Rule.intercept_batch_first``: linear and addmm, whose input ``[k*B, ..., I]``
holds sample i's rows where the vmap would hand them to it) is asked first,
and the vmap runs only where it declines (a shared row, anything else).

Note [Routing only for the per-call vmaps]
batchrules' routed kernels run only inside torch.func transforms, and the
only transforms of the engine's forward are its per-call vmaps. Turning
routing on re-registers some thirty kernels with the dispatcher, and off
again (csrc/routing.cpp): a fixed cost a forward would pay for nothing where
every call takes its rule on the plain batch (an MLP, a transformer's
linears). So the Interceptor turns it on at the forward's first per-call
vmap and restores it when the forward ends.
"""
from typing import Any, Callable, Dict, List, Optional, Tuple

from torch import Tensor
from torch.utils._pytree import _broadcast_to_and_flatten, tree_flatten, tree_unflatten

from .._compat import add_batch_dim, batched_level, remove_batch_dim, vmap_level
from .rule import BATCH_DIMS, BATCH_FIRST, NOT_HANDLED, NOT_SPLIT
from .tape import Tape

# A call's randomness (dropout inside a call that takes a parameter) per
# sample, as the batched call draws it.
_RANDOMNESS = "different"


def per_sample_call(tape: Tape, handle: Callable[[Callable, Tuple[Any, ...], Dict[str, Any]], Any],
                    routed: Callable[[], None], func: Callable, args: Tuple[Any, ...],
                    kwargs: Dict[str, Any]) -> Any:
    """``func(*args, **kwargs)`` split per sample (see the Note); ``handle``
    runs it at the tape's level (the Interceptor's rule-or-copies path),
    after ``routed()`` (Note [Routing only for the per-call vmaps])."""
    batch_first = BATCH_FIRST.get(func)  # Note [A rule on the plain batch]
    if batch_first is not None:
        out = batch_first(tape, args, kwargs)
        if out is not NOT_HANDLED:
            return out
    batch = tape.batch_size
    leaves, spec = tree_flatten((args, kwargs))
    declared = _declared(func, args, kwargs)
    in_dims = _broadcast_to_and_flatten(declared[0], spec) if declared else None
    if in_dims is None:
        in_dims = [None] * len(leaves)
    pieces: List[Tuple[Any, Optional[int]]] = []
    split: Dict[int, Tuple[Any, Optional[int]]] = {}  # by id: an argument passed twice stays one
    any_split = shared = False
    for leaf, dim in zip(leaves, in_dims):
        if id(leaf) not in split:
            split[id(leaf)] = _split(tape, leaf, dim)
        piece = split[id(leaf)]
        pieces.append(piece)
        any_split |= piece[1] is not None
        shared |= (piece[1] is None and isinstance(leaf, Tensor) and leaf.dim() > 0
                   and leaf.shape[0] == 1 and tape.param(leaf) is None)
    if not (any_split or shared):
        return func(*args, **kwargs)
    routed()
    with vmap_level(batch, _RANDOMNESS) as level:
        tape.level = level
        wrapped = [value if dim is None else add_batch_dim(value, dim, level)
                   for value, dim in pieces]
        call_args, call_kwargs = tree_unflatten(wrapped, spec)
        out = handle(func, call_args, call_kwargs)
        out_leaves, out_spec = tree_flatten(out)
        out_dims = _broadcast_to_and_flatten(declared[1], out_spec) if declared else None
        if out_dims is None:
            out_dims = [0] * len(out_leaves)
        joined = [_join(t, level, batch, d, func) for t, d in zip(out_leaves, out_dims)]
    return tree_unflatten(joined, out_spec)


def _declared(func: Callable, args: Tuple[Any, ...],
              kwargs: Dict[str, Any]) -> Optional[Tuple[Any, Any]]:
    batch_dims = BATCH_DIMS.get(func)
    return None if batch_dims is None else batch_dims(args, kwargs)


def _split(tape: Tape, leaf: Any, dim: Optional[int]) -> Tuple[Any, Optional[int]]:
    """The argument as the per-call vmap takes it: ``(physical [B, *piece], 0)``
    for an argument of the batch, ``(leaf, None)`` otherwise."""
    if (not isinstance(leaf, Tensor) or tape.param(leaf) is not None or leaf.dim() == 0
            or dim == NOT_SPLIT):
        return leaf, None
    batch = tape.batch_size
    if dim is not None:  # a rule's: the batch is there, sample i keeps it as a dim of size 1
        if leaf.shape[dim] != batch:
            raise RuntimeError(
                f"batchrules.dp: an argument of shape {tuple(leaf.shape)} holds the batch in dim "
                f"{dim}, which has size {leaf.shape[dim]}; the batch has {batch} samples")
        return leaf.movedim(dim, 0).unsqueeze(dim + 1), 0
    rows = leaf.shape[0]
    if rows % batch == 0:  # k = rows / B rows a sample, none for zero-length sequences
        return leaf.unflatten(0, (batch, rows // batch)), 0
    return leaf, None


def _join(t: Any, level: int, batch: int, dim: int, func: Callable) -> Any:
    """A result of the per-call vmap as rows of the batch again."""
    if not isinstance(t, Tensor) or batched_level(t) != level:
        return t
    value = remove_batch_dim(t, level, batch)  # [B, *per-sample]
    if dim == 0 and value.dim() > 1:
        return value.flatten(0, 1)  # B, k, ... -> B*k, ...
    if dim > 0 and value.dim() > dim + 1 and value.shape[dim + 1] == 1:
        return value.squeeze(dim + 1).movedim(0, dim)
    name = getattr(func, "__name__", repr(func))
    raise RuntimeError(
        f"batchrules.dp: {name} returned a per-sample result of shape {tuple(value.shape[1:])}, "
        "which cannot be laid back as rows of the batch (a reduction over the batch of a call "
        "that takes a parameter?); keep the batch in dim 0 of such a call's result")
