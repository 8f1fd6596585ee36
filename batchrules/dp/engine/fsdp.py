"""The engine on a model sharded by FSDP2's ``fully_shard``.

Note [The engine on an FSDP2 model]
The engine's forward runs the model with its own leaves in place of the
parameters (parameter_slots.py), and the user's backward still needs the full
weights the forward used (its saved tensors are views of them). FSDP's
forward hooks would unshard each block into its own parameters, reshard it
after the block's forward and hook the backward. So the engine unshards
every ``fully_shard``-ed module at once (FSDP's own ``unshard``: its
all-gathers), runs the forward with FSDP's forward hooks set aside, and
reshards at the end of the user's backward, once the clipping is done. At
the step each rank's full clipped sums go to the ranks' shards in one
reduce-scatter (``sharded.reduce_scatter_flat``), with the noise drawn once,
on the first rank, before it. Memory, as clipped_grad's FSDP recipe: the
full parameters of every block during a step, and the full clipped sums
until the reduce-scatter.
"""
import contextlib
from collections import OrderedDict
from typing import Any, Iterator, List

from torch import nn


def fsdp_modules(model: nn.Module) -> List[Any]:
    """The modules of ``model`` sharded with ``fully_shard`` (none without torch.distributed)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def unshard(modules: List[Any]) -> None:
    for m in modules:
        m.unshard()


def reshard(modules: List[Any]) -> None:
    for m in modules:
        m.reshard()


@contextlib.contextmanager
def hooks_set_aside(modules: List[Any]) -> Iterator[None]:
    """FSDP's forward hooks (and any other on these modules) off while entered."""
    saved = [(m, m._forward_pre_hooks, m._forward_hooks) for m in modules]
    try:
        for m, _, _ in saved:
            m._forward_pre_hooks, m._forward_hooks = OrderedDict(), OrderedDict()
        yield
    finally:
        for m, pre, post in saved:
            m._forward_pre_hooks, m._forward_hooks = pre, post


@contextlib.contextmanager
def plain_forwards(modules: List[Any]) -> Iterator[None]:
    """Full parameters and no FSDP hooks while entered (the first-step
    validation's forwards and backwards); resharded on exit."""
    if not modules:
        yield
        return
    unshard(modules)
    try:
        with hooks_set_aside(modules):
            yield
    finally:
        reshard(modules)
