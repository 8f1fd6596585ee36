"""One batched forward's record, read back by the user's ``loss.backward()``.

Note [The clipping runs at the end of the user's backward]
The engine cannot ask autograd for the tapped outputs' gradients as
clipped_grad does (one ``autograd.grad`` of its own): the user calls
``loss.backward()``. So each tapped output's node gets a pre-hook that keeps
the gradient reaching it, and the first hook to fire queues a callback that
autograd runs once the whole backward is done: it hands the gradients to the
uses and calls ``on_done`` (the engine's clipping, or the first-step
validation's norms), in the backward itself. The recorded activations are
then released before the next forward, and several backwards between two
optimizer steps (gradient accumulation, logical batches) each add their
clipped sums. The per-sample copies get tensor hooks too, so that a forward
whose parameters only reach the loss through them still calls back. A leaf
that receives a gradient was used by a call the batched forward could not
split (Note [A batched forward, one vmap per call]): reported, here or by
the leaf's own hook (Note [Leaves kept across forwards] in kept_leaves.py).
"""
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor
from torch.autograd import Variable

from ..tape import Param, Tape
from ..transform import _autocast_off


def escaped_error(names: List[str]) -> RuntimeError:
    """Parameters whose leaves received a gradient (Note [A batched forward,
    one vmap per call])."""
    return RuntimeError(
        f"batchrules.dp: {', '.join(names)} reached the loss through a call that cannot be split "
        "per sample (one with no argument holding the batch in dim 0, e.g. weight.t() or weight * "
        "2 outside a layer call, or inside a torch.func transform), so its per-sample gradient "
        "norm is unknown. Apply parameters through calls that take the batch (F.linear(x, w) "
        "rather than x @ w.t())")


def raise_escapes(leaves: Iterable[Tuple[Callable[[], str], Tensor]]) -> None:
    """Raises ``escaped_error`` naming each ``(namer, leaf)`` whose leaf received a
    gradient, once those gradients are cleared (the engine keeps its leaves for
    the next forward: Note [Leaves kept across forwards] in kept_leaves.py)."""
    names = []
    with torch._C.DisableTorchFunctionSubclass():  # the leaves' .grad, read directly
        for namer, leaf in leaves:
            if leaf.grad is not None:
                names.append(namer())
                leaf.grad = None
    if names:
        raise escaped_error(names)


class Recording:
    """A forward's tape and parameters; ``on_done(self)`` after its backward."""

    def __init__(self, tape: Tape, params: List[Param],
                 on_done: Callable[["Recording"], None]) -> None:
        self.tape, self.params, self.on_done = tape, params, on_done
        self.grads: Dict[int, Tensor] = {}  # a use's index on the tape -> its output's gradient
        self.queued = self.done = False
        by_node: Dict[object, List[int]] = {}
        for i, use in enumerate(tape.uses):
            by_node.setdefault(use.edge.node, []).append(i)
        for node, indices in by_node.items():
            node.register_prehook(self._keeper(indices))  # type: ignore[attr-defined]
        for p in params:  # the leaves' own hooks: kept_leaves.py
            if p.copy is not None:
                p.copy.register_hook(self._on_leaf_grad)

    def _keeper(self, indices: List[int]) -> Callable[..., None]:
        def keep(grad_outputs: List[Optional[Tensor]]) -> None:
            self._started()
            for i in indices:
                g = grad_outputs[self.tape.uses[i].edge.output_nr]
                if g is not None:
                    self.grads[i] = g
        return keep

    def _on_leaf_grad(self, grad: Tensor) -> None:
        self._started()

    def _started(self) -> None:
        if self.done:
            raise RuntimeError(
                "batchrules.dp: a second backward through the same forward: each forward's "
                "per-sample gradients are clipped once, at the end of its backward; run the "
                "forward again (or sum the losses and call backward once)")
        if not self.queued:
            self.queued = True
            Variable._execution_engine.queue_callback(self._finish)

    def _finish(self) -> None:
        self.done = True
        raise_escapes((p.namer, p.leaf) for p in self.params)
        self.tape.check_inputs_unchanged()
        self.tape.take_grads([self.grads.pop(i, None) for i in range(len(self.tape.uses))])
        for p in self.params:
            if p.copy is not None:
                p.copy_grad = p.copy.grad
        with torch.no_grad(), _autocast_off(self.params):
            self.on_done(self)
        for p in self.params:  # a Param and its uses refer to each other
            p.uses.clear()
            p.copy = p.copy_grad = None
        self.tape.uses.clear()
