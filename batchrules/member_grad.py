"""A member's ``torch.func.grad`` as one plain autograd backward, for
``ensemble_vmap``'s member loop.

Note [A member's gradient without torch.func]
``ensemble_vmap(grad(loss), ...)``'s member loop calls ``grad(loss)`` once a
member. torch.func's grad wraps every argument at a new level and runs its
backward with ``create_graph=True`` (so that an enclosing transform or outer
autograd can differentiate the result): the backward records a graph of its
own, and the wrapping costs a fixed ~0.3 ms a call (a 3-layer MLP). Where no
enclosing level exists (the loop runs only at the top level) and nothing
outside the call requires grad, no one can differentiate the result, and the
same gradients come from ``torch.autograd.grad`` on detached leaves without
``create_graph``: the same operators, with the values grad returns (zeros for
an unused input, the results detached). Where grad mode is on at the call (under
``torch.no_grad`` grad's own results record nothing outside it), two things
could differentiate it, and either sends the call to ``grad`` itself:
- an argument that requires grad (it would carry its graph into the result);
- a tensor outside the arguments (a closure's parameter) that requires grad
  and reached the loss or the aux, as a leaf of the recorded graph.
Anything grad would refuse (a non-tensor or integer input to differentiate, a
loss that is not a scalar tensor, a malformed aux) goes to ``grad`` too, so its
errors are grad's own. The closure's case is only seen once the member's loss
has run: that member's forward runs again under ``grad``, and the call's
remaining members go to ``grad`` directly.
"""
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Set, Tuple

import torch
from torch import Tensor
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map, tree_unflatten


def _code_of(transform: Callable[..., Any]) -> Any:
    return getattr(transform(lambda x: x), "__code__", None)


# Every function torch.func.grad (grad_and_value) returns shares one code
# object, whose closure holds the loss, argnums and has_aux.
_GRAD_CODES = {_code_of(torch.func.grad): False, _code_of(torch.func.grad_and_value): True}
_CLOSURE = ("func", "argnums", "has_aux")


class MemberGrad(NamedTuple):
    """``grad(func, argnums, has_aux)`` (``with_value``: ``grad_and_value``)
    as what it computes, for the member loop's calls (``bind``; Note [A
    member's gradient without torch.func]); ``transform`` is the original,
    called where it must be."""
    transform: Callable[..., Any]
    func: Callable[..., Any]
    argnums: Any
    has_aux: bool
    with_value: bool

    @staticmethod
    def of(transform: Callable[..., Any]) -> Optional["MemberGrad"]:
        """The MemberGrad of a function ``torch.func.grad`` or
        ``grad_and_value`` returned; None for any other."""
        code = getattr(transform, "__code__", None)
        closure = getattr(transform, "__closure__", None)
        if code is None or code not in _GRAD_CODES or closure is None:
            return None
        cells: Dict[str, Any] = dict(zip(code.co_freevars, (c.cell_contents for c in closure)))
        if not all(name in cells for name in _CLOSURE):
            return None
        return MemberGrad(transform, cells["func"], cells["argnums"], cells["has_aux"], _GRAD_CODES[code])

    def bind(self, leaves: List[Any], spec: TreeSpec, kwargs: Dict[str, Any]
             ) -> Callable[[List[Any]], Any]:
        """The call on one member's ``leaves`` (of the arguments' ``spec``:
        each the stacked leaf's slice), for stacked ``leaves``: the plain
        backward, or ``transform`` where grad must run (Note [A member's
        gradient without torch.func])."""
        def transform(member: List[Any]) -> Any:
            return self.transform(*tree_unflatten(member, spec), **kwargs)
        arguments = _differentiated_arguments(spec, self.argnums)
        recorded_outside = torch.is_grad_enabled()
        if arguments is None or (recorded_outside and any(
                isinstance(t, Tensor) and t.requires_grad for t in (*leaves, *tree_flatten(kwargs)[0]))):
            return transform
        differentiated = [i for start, stop, _ in arguments for i in range(start, stop)]
        if not all(isinstance(leaves[i], Tensor) and (leaves[i].is_floating_point() or leaves[i].is_complex())
                   for i in differentiated):
            return transform

        closure_requires_grad = False

        def plain_backward(member: List[Any]) -> Any:
            nonlocal closure_requires_grad
            if closure_requires_grad:
                return transform(member)
            inputs = list(member)
            for i in differentiated:
                inputs[i] = member[i].detach().requires_grad_()
            with torch.enable_grad():
                out = self.func(*tree_unflatten(inputs, spec), **kwargs)
            loss, aux = _loss_and_aux(out, self.has_aux)
            own = [inputs[i] for i in differentiated]
            if loss is None:
                return transform(member)
            if recorded_outside and _reaches_other_leaves(loss, aux, {id(t) for t in own}):
                closure_requires_grad = True
                return transform(member)
            grads, per_argument, offset = _grads(loss, own), [], 0
            for start, stop, arg_spec in arguments:
                per_argument.append(tree_unflatten(grads[offset:offset + stop - start], arg_spec))
                offset += stop - start
            result = per_argument[0] if isinstance(self.argnums, int) else tuple(per_argument)
            if self.with_value:
                value = (loss.detach(), _detached(aux)) if self.has_aux else loss.detach()
                return result, value
            return (result, _detached(aux)) if self.has_aux else result
        return plain_backward


def _differentiated_arguments(spec: TreeSpec, argnums: Any) -> Optional[List[Tuple[int, int, TreeSpec]]]:
    """Each differentiated argument's leaves' range among the arguments'
    (``spec``: of the tuple of arguments) and its spec; None where grad would
    refuse ``argnums``."""
    positions = _positions(argnums, spec.num_children)
    if positions is None:
        return None
    starts = [0]
    for child in spec.children():
        starts.append(starts[-1] + child.num_leaves)
    return [(starts[i], starts[i + 1], spec.child(i)) for i in positions]


def _positions(argnums: Any, count: int) -> Optional[Tuple[int, ...]]:
    """``argnums`` as positions, or None where grad would refuse them."""
    nums = (argnums,) if isinstance(argnums, int) else argnums
    if not isinstance(nums, tuple) or not nums or not all(isinstance(n, int) and -count <= n < count
                                                          for n in nums):
        return None
    positions = tuple(n % count for n in nums)
    return positions if len(set(positions)) == len(positions) else None


def _loss_and_aux(out: Any, has_aux: bool) -> Tuple[Optional[Tensor], Any]:
    """The scalar loss and the aux (a pytree of tensors), or (None, None)
    where grad would refuse them."""
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2
                and all(isinstance(t, Tensor) for t in tree_flatten(out[1])[0])):
            return None, None
        out, aux = out
    else:
        aux = None
    return (out, aux) if isinstance(out, Tensor) and out.dim() == 0 else (None, None)


def _reaches_other_leaves(loss: Tensor, aux: Any, leaves: Set[int]) -> bool:
    """Whether the graph behind the loss and the aux has a leaf that requires
    grad other than ``leaves`` (their ids)."""
    roots = [t for t in (loss, *tree_flatten(aux)[0]) if isinstance(t, Tensor) and t.requires_grad]
    seen: Set[Any] = set()
    stack = [t.grad_fn for t in roots]
    for t in roots:
        if t.grad_fn is None and id(t) not in leaves:  # a leaf itself (aux returning a parameter)
            return True
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad's leaf
        if variable is not None and id(variable) not in leaves:
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


def _grads(loss: Tensor, leaves: List[Tensor]) -> List[Tensor]:
    """d loss / d leaves, zeros for those it does not reach (as grad returns them)."""
    if not loss.requires_grad:
        return [torch.zeros_like(t) for t in leaves]
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]


def _detached(tree: Any) -> Any:
    return tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, tree)
