"""The intercepted leaves the engine's forwards run with, kept from one forward
to the next.

Note [Leaves kept across forwards]
Each forward runs the model with its trainable parameters replaced by
intercepted leaves (Note [Intercepting only the calls that take a parameter]
in interceptor.py). A leaf is a detached view of the parameter's data, so the
optimizer's in-place update reaches it; making one afresh at each forward,
with a tensor hook of its own, is a fixed cost per parameter and step. So a
leaf is kept while its parameter is the same object holding the same data
(address, shape, strides, dtype, device): a parameter replaced, or whose
``.data`` was reassigned (``.to()``, ``p.data = ...``), gets a new one.

A kept leaf's one hook reports escapes: a leaf receives a gradient only
through a call the batched forward could not split (Note [A batched forward,
one vmap per call] in batched_forward.py). The first such gradient of a
backward queues a check that runs once that backward is done and raises
naming every parameter whose leaf received one (escaped_error); the leaves'
gradients are cleared first, so the next forward starts clean. The clipping's
own check at the end of the backward (recording.py) does the same where the
recorded uses' outputs reached the loss too.
"""
import functools
from typing import Dict, List, Tuple

import torch
from torch import Tensor, nn
from torch.autograd import Variable

from ..interceptor import intercepted_leaf
from ..tape import Param
from .recording import raise_escapes


class KeptLeaves:
    """The parameters' intercepted leaves, by parameter (see the Note)."""

    def __init__(self) -> None:
        # by id(parameter): (parameter, its data as a plain tensor, the leaf, its name)
        self._kept: Dict[int, Tuple[nn.Parameter, Tensor, Tensor, str]] = {}
        self._check_queued = False

    def __reduce__(self) -> Tuple[type, Tuple[()]]:
        """A copy or a pickle of the module starts with none kept (they are a cache)."""
        return KeptLeaves, ()

    def params(self, named: List[Tuple[str, nn.Parameter]]) -> List[Param]:
        """A forward's ``Param`` of each of ``named``, with its kept leaf."""
        kept: Dict[int, Tuple[nn.Parameter, Tensor, Tensor, str]] = {}
        out = []
        self._check_queued = False  # a backward that raised may have left it set
        with torch._C.DisableTorchFunctionSubclass():  # the leaves' methods, called directly
            for i, (name, p) in enumerate(named):
                entry = self._kept.get(id(p))
                if entry is None or entry[0] is not p or not _same_data(p, entry[1]):
                    value = p.detach()
                    leaf = intercepted_leaf(value)
                    leaf.register_hook(self._on_grad)
                    entry = (p, value, leaf, name)
                else:
                    if entry[2].grad is not None:  # left by a backward that raised
                        entry[2].grad = None
                    entry = (p, entry[1], entry[2], name)
                kept[id(p)] = entry
                out.append(Param(i, functools.partial(str, name), entry[2], entry[1]))
        self._kept = kept
        return out

    def _on_grad(self, grad: Tensor) -> None:
        if not self._check_queued:
            self._check_queued = True
            Variable._execution_engine.queue_callback(self._report)

    def _report(self) -> None:
        self._check_queued = False
        raise_escapes((functools.partial(str, name), leaf) for _, _, leaf, name in self._kept.values())


def _same_data(p: nn.Parameter, value: Tensor) -> bool:
    """Whether ``value`` (a detached view made from ``p``) still views ``p``'s data."""
    return (p.data_ptr() == value.data_ptr() and p.shape == value.shape
            and p.stride() == value.stride() and p.dtype == value.dtype
            and p.device == value.device)
