"""Data-parallel DP-SGD: clipped sums across ranks, one collective per step.

``clipped_grad`` differentiates plain tensors and never goes through DDP's or
FSDP's autograd hooks, so the clipped sums are reduced explicitly:

- DDP (every rank holds the full model): ``all_reduce_flat(sums)``, one
  ``all_reduce`` of all the sums flattened into one buffer.
- FSDP2 (``torch.distributed.fsdp.fully_shard``: every rank holds a dim-0
  shard of each parameter): ``with unsharded(model) as params`` all-gathers
  the full parameters with FSDP's own ``FSDPModule.unshard`` and reshards on
  exit; ``reduce_scatter_flat(sums, dict(model.named_parameters()))`` then
  sums the full clipped sums over ranks and leaves each rank only its shard,
  with one ``reduce_scatter_single`` (not FSDP's post-backward reduce-scatter,
  which only private FSDP state can trigger without an FSDP backward).

Recipe (2 ranks; ``arch`` is the architecture for ``functional_call``)::

    arch = copy.deepcopy(model).to("meta")   # before sharding; holds no data
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)

    def loss(p, x, y):                        # one sample, as for clipped_grad
        return F.cross_entropy(functional_call(arch, p, (x[None],)), y[None])

    with unsharded(model) as params:         # full tensors, FSDP's all-gather
        sums, norms = batchrules.clipped_grad(loss, C)(params, x_rank, y_rank)
    shards = reduce_scatter_flat(sums, dict(model.named_parameters()))
    for name, p in model.named_parameters():
        p.grad = (shards[name] + noise for this rank's shard) / expected_batch
    optimizer.step()

The loss calls ``arch``, not ``model``: FSDP's forward hooks would reshard
and register backward hooks under ``clipped_grad``'s vmap. (``model`` itself
still runs as usual, e.g. for evaluation.)

Memory: between steps a rank holds only its shards of the parameters and
gradients. During a step it holds the full parameters of every block at once
(``clipped_grad``'s single forward needs them all, where FSDP's own forward
gathers block by block) and the full clipped sums until the reduce-scatter.
"""
import contextlib
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

if TYPE_CHECKING:  # imported where used: importing batchrules does not import DTensor
    from torch.distributed.tensor import DTensor


def all_reduce_flat(tree: Any, group: Optional["dist.ProcessGroup"] = None) -> Any:
    """The pytree of tensors summed over the ranks of ``group``, with one
    ``all_reduce`` of one flat buffer (all leaves must share a dtype and
    device). Returns a new pytree; the inputs are not modified."""
    leaves, spec = tree_flatten(tree)
    if not leaves:
        return tree
    flat = torch.cat([t.reshape(-1) for t in leaves])
    dist.all_reduce(flat, group=group)
    return tree_unflatten(_split(flat, [t.shape for t in leaves]), spec)


@contextlib.contextmanager
def unsharded(model: nn.Module) -> Iterator[Dict[str, Tensor]]:
    """All-gather every ``fully_shard``-ed module of ``model`` (FSDP's own
    ``FSDPModule.unshard``) and yield ``{name: full parameter, detached}`` for
    ``clipped_grad``; reshard (free the full parameters) on exit."""
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("unsharded: no module of the model was sharded with fully_shard")
    try:
        for m in modules:
            m.unshard()
        yield {k: p.detach() for k, p in model.named_parameters()}
    finally:
        for m in modules:
            m.reshard()


def reduce_scatter_flat(full: Dict[str, Tensor], sharded: Dict[str, Tensor],
                        group: Optional["dist.ProcessGroup"] = None) -> Dict[str, "DTensor"]:
    """``full`` (one full-size tensor per name, e.g. this rank's clipped sums)
    summed over the ranks, each rank keeping only its shard: a DTensor laid
    out as ``sharded[name]`` (FSDP2's ``Shard(0)`` on a 1-D mesh). One
    ``reduce_scatter_single`` of one flat buffer in which every tensor is
    split along dim 0 as FSDP splits it (``torch.chunk``, trailing ranks
    possibly empty) and padded to equal chunks."""
    from torch.distributed.tensor import DTensor, Shard

    names = list(sharded)
    like: List[DTensor] = []
    for k in names:
        t = sharded[k]
        if not (isinstance(t, DTensor) and t.device_mesh.ndim == 1
                and tuple(t.placements) == (Shard(0),)):
            raise ValueError(f"reduce_scatter_flat: {k} is not a DTensor sharded on dim 0 of a "
                             "1-D mesh (fully_shard's layout)")
        like.append(t)
    mesh = like[0].device_mesh
    group = group if group is not None else mesh.get_group()
    world = dist.get_world_size(group)
    # FSDP's rows per rank (the last ranks' padded)
    row_shapes = [(-(-t.shape[0] // world), *t.shape[1:]) for t in like]
    send = _pack([full[k] for k in names], row_shapes, world)
    recv = send.new_empty(send.numel() // world)
    dist.reduce_scatter_single(recv, send, group=group)
    shards: List[DTensor] = []
    for t, piece in zip(like, _split(recv, row_shapes)):
        local = piece[:t.to_local().shape[0]]  # a view of recv: no copy
        shards.append(DTensor.from_local(local, mesh, [Shard(0)], shape=t.shape, stride=t.stride()))
    return dict(zip(names, shards))


def _pack(tensors: List[Tensor], row_shapes: List[Tuple[int, ...]], world: int) -> Tensor:
    """The reduce-scatter input: for each rank in turn, its rows of every
    tensor (``row_shapes``, zero-padded), flat; the only full-size temporary."""
    sizes = [int(torch.Size(s).numel()) for s in row_shapes]
    send = tensors[0].new_zeros(world, sum(sizes))
    for r in range(world):
        for piece, t, shape in zip(send[r].split(sizes), tensors, row_shapes):
            part = t[r * shape[0]:(r + 1) * shape[0]].reshape(-1)
            piece[:part.numel()] = part
    return send.view(-1)


def _split(flat: Tensor, shapes: Sequence[Sequence[int]]) -> List[Tensor]:
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    return [piece.view(*s) for piece, s in zip(flat.split(sizes), shapes)]
