"""``PrivateModule`` inside ``torch.compile``.

Note [The engine under torch.compile]
Eagerly, the clipping hangs on the user's ``loss.backward()`` through hooks
on the autograd nodes of the batched forward (Note [The clipping runs at the
end of the user's backward] in recording.py). A compiled graph has no such
nodes. So under Dynamo the forward is one ``autograd.Function``
(``_ClippedForward``) called from a ``torch._dynamo.nonstrict_trace``
function: Dynamo puts the call in its graph as it is (``fullgraph=True``
holds) and AOTAutograd traces through it, as for clipped_grad (Note
[clipped_grad under torch.compile] in compiled_step.py). The Function's
forward runs the batched forward (Note [A batched forward, one vmap per
call]) on a graph of its own; its backward asks that graph for the recorded
outputs' gradients, clips, and returns the clipped sums. AOTAutograd traces
the clipping into the compiled backward, with the rest of the model's.

The clipped sums are the gradients of "sinks": one leaf per trainable
parameter, a zero expanded to its shape (no memory), which the Function
takes as inputs. Autograd accumulates them in ``sink.grad``, across the
backwards of a logical batch, and the ``DPOptimizer`` takes them from there:
``p.grad`` is left for the noised gradient it writes. A scalar sink whose
gradient is 1 per backward counts the backwards. The sinks are made outside
the compiled region: when the DPOptimizer is attached, after ``.to()``, and
at a step after which the trainable parameters changed (a compiled forward
meeting other trainable parameters than its sinks' raises). The first
compiled forward keeps its inputs for the validation; the next one compiles
again, once, as the validation has then started. The spec is guarded by
identity (the traced body hides the model's code from Dynamo's guards), so
each PrivateModule, DPOptimizer attached or ``.to()`` compiles anew, and
Dynamo's ``recompile_limit`` (8) bounds how many one process compiles before
``torch._dynamo.reset()``.

The model's parameters and buffers are read from its modules' dicts where
Dynamo lifts them as inputs of the graph, as for clipped_grad's loss (Note
[What the loss closes over]): no tensor is a constant of the graph. What is
not available compiled: ``per_sample_norms`` (the norms stay inside the
backward), and the first-step validation's cotangents, which are drawn at
random instead of kept from the user's backward (validation.py).
"""
import functools
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.utils._pytree import register_constant, tree_flatten, tree_unflatten

from ... import routing
from ..._compat import reparametrized
from ..._post_import import when_imported
from ..clipping import clip
from ..compiled_step import _detached, _thawed, module_slots
from ..interceptor import Interceptor, intercepted_leaf
from ..layers import INTERCEPTS
from ..tape import Param, Tape
from ..transform import _autocast_off
from .recording import escaped_error


class ForwardSpec:
    """What a compiled forward fixes: the model, its trainable parameters'
    names, the clipping bound and the loss reduction (a constant of the
    graph, compared by identity)."""

    def __init__(self, model: nn.Module, names: Tuple[str, ...], max_grad_norm: float,
                 loss_reduction: str) -> None:
        self.model, self.names = model, names
        self.max_grad_norm, self.loss_reduction = max_grad_norm, loss_reduction
        self.slots = module_slots(model)

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)


register_constant(ForwardSpec)


def make_sinks(params: List[nn.Parameter]) -> Tuple[List[Tensor], Tensor]:
    """A sink per parameter and the backwards' counter (see the Note)."""
    sinks = [torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape).requires_grad_()
             for p in params]
    device = params[0].device if params else None
    return sinks, torch.zeros((), device=device, requires_grad=True)


def state_of(spec: ForwardSpec) -> Dict[str, Tensor]:
    """The model's parameters and buffers by name, read under Dynamo (a tied
    weight one input under each of its names)."""
    return {prefix + name: t for prefix, slots in spec.slots for name, t in slots.items()
            if t is not None}


class _ClippedForward(torch.autograd.Function):
    """The batched forward; its backward clips (see the Note). The inputs:
    the spec, a dict the structure of the inputs and outputs passes through,
    the counter, the sinks, then the tensors of the model's arguments."""

    @staticmethod
    def forward(ctx: Any, spec: ForwardSpec, box: Dict[str, Any], count: Tensor,
                *tensors: Tensor) -> Tuple[Tensor, ...]:
        inputs = tensors[len(spec.names):]
        with torch.enable_grad():
            inner = [t.detach().requires_grad_() if t.requires_grad else t for t in inputs]
            args, kwargs = _rebuilt(box, inner)
            batch = box["batch"]
            state = _detached(box["state"])  # one per tensor: a tie holds
            params = [Param(i, functools.partial(str, name), intercepted_leaf(state[name], True),
                            state[name]) for i, name in enumerate(spec.names)]
            leaf_of = {id(state[n]): p.leaf for n, p in zip(spec.names, params)}
            full = {name: leaf_of.get(id(t), t) for name, t in state.items()}
            tape = Tape(params, batch, -1, batched=True)
            if batch == 0:  # nothing to split or clip: the sums are zero
                with reparametrized([spec.model], [state]):
                    out = spec.model(*args, **kwargs)
            else:
                with reparametrized([spec.model], [full]), Interceptor(tape, INTERCEPTS, traced=True), \
                        routing.enabled():
                    out = spec.model(*args, **kwargs)
        leaves, box["out_spec"] = tree_flatten(out)
        box["out_leaves"] = leaves
        outs = [t for t in leaves if isinstance(t, Tensor)]
        ctx.spec, ctx.tape, ctx.params, ctx.batch = spec, tape, params, batch
        ctx.count = (count.dtype, count.device)
        ctx.outs = outs
        ctx.inner = [t for t in inner if t.requires_grad]
        ctx.asked = [t.requires_grad for t in inputs]
        result = tuple(t.detach() for t in outs)
        ctx.mark_non_differentiable(*[r for r in result if not r.is_floating_point()])
        return result

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        spec, tape, params, batch = ctx.spec, ctx.tape, ctx.params, ctx.batch
        reached = [(o, g) for o, g in zip(ctx.outs, grads) if o.requires_grad and g is not None]
        edges = [u.edge for u in tape.uses]
        copied = [p for p in params if p.copy is not None]
        wanted: List[Any] = edges + [p.copy for p in copied] + [p.leaf for p in params] + ctx.inner
        got: Tuple[Optional[Tensor], ...] = (None,) * len(wanted)
        if reached and wanted:
            with torch.enable_grad():
                got = torch.autograd.grad([o for o, _ in reached], wanted, [g for _, g in reached],
                                          allow_unused=True)
        at = len(edges) + len(copied)
        escaped = [p.name for p, g in zip(params, got[at:at + len(params)]) if g is not None]
        if escaped:
            raise escaped_error(escaped)
        tape.check_inputs_unchanged()
        tape.take_grads(got[:len(edges)])
        for p, g in zip(copied, got[len(edges):at]):
            p.copy_grad = g
        with torch.no_grad(), _autocast_off(params):
            scale = batch if spec.loss_reduction == "mean" else 1.0
            sums, _ = clip(params, batch, spec.max_grad_norm, scale, in_place=False)
        for p in params:  # a Param and its uses refer to each other
            p.uses.clear()
        input_grads = iter(got[at + len(params):])
        dtype, device = ctx.count
        return (None, None, torch.ones((), dtype=dtype, device=device), *sums,
                *[next(input_grads) if asked else None for asked in ctx.asked])


def _rebuilt(box: Dict[str, Any], tensors: List[Tensor]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """The model's arguments with ``tensors`` in their tensors' places."""
    it = iter(tensors)
    leaves = [next(it) if isinstance(x, Tensor) else x for x in box["in_leaves"]]
    return tree_unflatten(leaves, box["in_spec"])


def _run_traced(spec: ForwardSpec, sinks: List[Tensor], count: Tensor, state: Dict[str, Tensor],
                args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    from .module import batch_size  # module.py imports this file

    state = _thawed(state)
    _check_trainable(spec, sinks, state)
    in_leaves, in_spec = tree_flatten((_thawed(args), _thawed(kwargs)))
    batch = batch_size(args, kwargs)
    box: Dict[str, Any] = {"state": state, "batch": batch, "in_leaves": in_leaves, "in_spec": in_spec}
    tensors = [x for x in in_leaves if isinstance(x, Tensor)]
    outs = iter(_ClippedForward.apply(spec, box, count, *sinks, *tensors))
    leaves = [next(outs) if isinstance(x, Tensor) else _returnable(x) for x in box["out_leaves"]]
    return tree_unflatten(leaves, box["out_spec"])


def _check_trainable(spec: ForwardSpec, sinks: List[Tensor], state: Dict[str, Tensor]) -> None:
    """Raises if the trainable parameters are no longer the spec's."""
    seen, trainable = set(), set()
    for name, t in state.items():
        if t.requires_grad and id(t) not in seen:
            trainable.add(name)
        seen.add(id(t))
    if trainable != set(spec.names) or any(
            s.dtype != state[n].dtype or s.device != state[n].device for n, s in zip(spec.names, sinks)):
        raise RuntimeError(
            "batchrules.dp: the model's trainable parameters changed (requires_grad, dtype or "
            "device) since the DPOptimizer's last step, other than through the module's .to(): "
            "the compiled forward needs the engine to see them first; run an optimizer step, or "
            "create the DPOptimizer again")


_BASIC = (int, float, bool, str, type(None), torch.dtype, torch.device)


def _returnable(x: Any) -> Any:
    """An output leaf a compiled call may return: an object of none of the
    basic types (transformers' key/value cache) is dropped, with a warning."""
    if isinstance(x, _BASIC):
        return x
    warnings.warn(f"batchrules.dp: a compiled PrivateModule's output drops its {type(x).__name__} "
                  "(torch.compile returns only tensors and basic types from the engine's forward); "
                  "pass use_cache=False to a transformers model", stacklevel=2)
    return None


_entry: Optional[Any] = None


def _register(dynamo: Any) -> None:
    global _entry
    _entry = dynamo.nonstrict_trace(_run_traced)


when_imported("torch._dynamo", _register)


def traced_forward(spec: ForwardSpec, sinks: List[Tensor], count: Tensor,
                   args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """The forward while Dynamo traces (see the Note)."""
    assert _entry is not None  # Dynamo is imported while it traces
    return _entry(spec, sinks, count, state_of(spec), args, kwargs)
