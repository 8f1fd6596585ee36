"""What clipped_grad records during the forward: the parameters and their uses."""
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, get_gradient_edge

from .. import _C
from .._compat import add_batch_dim, allow_requires_grad, is_view, version_counter

if TYPE_CHECKING:
    from .rule import Use


# Note [Tapping an output that may later change in place]
# The backward targets each intercepted output by its autograd edge (the node
# that produced it and the output number), taken right after the call. A later
# in-place op on the output (nn.ReLU(inplace=True) after a Linear) or on a
# view of it rebases the tensor's history onto a new node, but the original
# node stays on the path to the loss, so its edge still receives the gradient
# with respect to the value the call produced. That holds only if the tapped
# tensor is not itself a view (an in-place op on a view replaces the view's
# node by CopySlices on its base), so the rules run their op on 2-D/folded
# physical operands, whose outputs are fresh tensors, and hand the caller
# those or views of them. An output needs a node at all: when no operand
# requires grad (a first layer, whose input is data), the rule passes a
# detached copy of the weight that requires grad. Its node is never executed:
# its only edge leads to that copy, which the backward does not ask for.
def tap(out: Tensor) -> GradientEdge:
    """The edge a rule's physical output is read back through (an output
    computed without grad is anchored first: Note [Anchored outputs])."""
    if out.grad_fn is None and not out.requires_grad:
        _C._anchor(out)
    if is_view(out) or out.grad_fn is None:
        raise AssertionError("clipped_grad: a tapped output must be a fresh tensor with a node")
    return get_gradient_edge(out)


def weight_for(tape: "Tape", weight: Tensor, other_operands_need_grad: bool) -> Tensor:
    """The detached weight a rule calls its op with (see the Notes above)."""
    if other_operands_need_grad or tape.anchored:
        param = tape.param(weight)
        return param.value if param is not None else weight.detach()
    with allow_requires_grad():
        return weight.detach().requires_grad_()


# Note [Anchored outputs]
# Under clipped_grad the backward asks autograd for the tapped edges only, so
# the node of an output whose operands need no grad (a first layer's, made
# with a weight that requires grad: Note [Tapping an output that may later
# change in place]) is never executed. The engine's user calls
# ``loss.backward()``, which runs every node on a path to a leaf: that node
# would form the layer's summed weight gradient (an embedding's a dense
# [V, D] table), thrown away. So in the engine (``Tape.anchored``) the op runs
# with detached operands and ``tap`` gives its fresh output a node of its own
# whose backward computes nothing (``batchrules::anchor``, in C++: an
# autograd.Function would meet functorch's checks inside the per-call vmap).
# The output gradient reaches the tap, and nothing is computed from it.


@dataclass(eq=False)
class Param:
    """A differentiated tensor: its name (key path) for messages, the leaf the
    loss sees (Note [Intercepting only the calls that take a parameter] in
    interceptor.py), its intercepted uses (after the backward, those whose
    output reached the loss) and, when some use could not be ghosted, its
    per-sample copy (see Note [Per-sample copies])."""

    index: int
    namer: Callable[[], str]
    leaf: Tensor  # an interceptor.Differentiated
    value: Tensor  # the leaf's data as a plain tensor (no interception)
    uses: List["Use"] = field(default_factory=list)
    copy: Optional[Tensor] = None  # physical [B, *shape] leaf
    copy_grad: Optional[Tensor] = None

    @property
    def name(self) -> str:
        return self.namer()


# Note [Per-sample copies]
# A call that uses a parameter and that no rule handles (F.layer_norm's
# weight, p * x, W.T @ x, a call inside a nested transform) gets, in place of
# the parameter, a detached copy expanded to [B, *shape] (no memory), a leaf
# that requires grad, batched at clipped_grad's vmap level. The vmapped call
# then sees what vmap(grad) would: a per-sample parameter. Autograd
# accumulates into that one leaf the gradient of every such use: exactly the
# per-sample gradient through those uses, [B, *shape], materialized for these
# parameters only.
class Tape:
    """Parameters by identity, the batch size and vmap level, recorded uses."""

    def __init__(self, params: List[Param], batch_size: int, level: int,
                 batched: bool = False, anchored: bool = False) -> None:
        self.params = params
        self.by_id: Dict[int, Param] = {id(p.leaf): p for p in params}
        self.batch_size = batch_size
        self.level = level  # the engine's: each call's own (batched_forward.py)
        self.batched = batched  # the engine's batched forward (batched_forward.py)
        self.anchored = anchored  # Note [Anchored outputs]
        self.uses: List["Use"] = []
        self.versions: List[Tuple[Tensor, int, "Use", str]] = []

    def param(self, obj: object) -> Optional[Param]:
        return self.by_id.get(id(obj)) if isinstance(obj, Tensor) else None

    def record(self, use: "Use", inputs: Tuple[Tensor, ...], op: str) -> None:
        """Adds a use of ``op`` ("linear", ...); ``inputs`` must keep their
        values until the backward."""
        self.uses.append(use)
        for param in use.roles():
            param.uses.append(use)
        for t in inputs:
            self.versions.append((t, version_counter(t), use, op))

    def per_sample_copy(self, param: Param) -> Tensor:
        """The batched per-sample copy of ``param`` (Note [Per-sample copies])."""
        if param.copy is None:
            leaf = param.value
            with allow_requires_grad():
                param.copy = leaf.expand(self.batch_size, *leaf.shape).requires_grad_()
        return add_batch_dim(param.copy, 0, self.level)

    def take_grads(self, grads: Sequence[Optional[Tensor]]) -> None:
        """Hands each use, in order, its output's gradient; a use whose
        gradient is None (its output did not reach the loss) is dropped from
        its parameters' uses, which the clipping then sees."""
        reached = set()
        for use, g in zip(self.uses, grads):
            if g is not None:
                # See Note [clipped_grad under autocast] in transform.py.
                dtype = next(iter(use.roles())).value.dtype
                use.set_grad(g if g.dtype == dtype else g.to(dtype))
                reached.add(use)
        for p in self.params:
            p.uses = [u for u in p.uses if u in reached]

    def check_inputs_unchanged(self) -> None:
        """Raises if a recorded input changed in place; then forgets them."""
        for t, version, use, op in self.versions:
            if version_counter(t) != version:
                weight = next(p for p, role in use.roles().items() if role == "weight")
                raise RuntimeError(
                    f"clipped_grad: the input of the {op} of {weight.name} was modified in place "
                    "after the call; the per-sample gradient norms need its value at the call. "
                    "Use an out-of-place op there (e.g. x = x.relu() instead of x.relu_()).")
        self.versions.clear()


def zeros_grad(param: Param, batch_size: int) -> Tensor:
    return torch.zeros((batch_size, *param.value.shape), dtype=param.value.dtype,
                       device=param.value.device)
