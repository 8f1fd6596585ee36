"""``clipped_grad`` inside ``torch.compile``.

Note [clipped_grad under torch.compile]
Dynamo cannot trace clipped_grad's body: its own vmap levels, the recorded
autograd edges and ``torch.autograd.grad`` over them. So under Dynamo the call
is a ``torch._dynamo.nonstrict_trace`` function: Dynamo puts it in its graph as
one opaque call (no graph break, ``fullgraph=True`` holds), and AOTAutograd then
traces through the body as plain Python, with its functional, fake and proxy
modes: the forward under vmap, the one backward and the clipping become aten
ops of the caller's graph, and Inductor compiles them with the caller's noise
and update. The body is the eager one, with the interception a torch function
mode (Note [Intercepting while traced] in interceptor.py) and no in-place
scaling of output gradients whose storages cannot be told apart while traced.

Batch sizes: Dynamo's automatic dynamic shapes make the batch symbolic at the
second size, and the body's shape-dependent choices (the cost model's
strategies) become guards of that one graph, so a Poisson-sampled batch
compiles once more at most when a choice flips, not once per size. A kernel
that reads concrete sizes specializes it (the recurrence ops have fake kernels
for that: recurrent_fakes.py); torch's batching rule of ``cat`` does
(transformers' caches: pass ``use_cache=False``), and such a model compiles
once per batch size.

The ``StepSpec`` (the loss, max_norm, ...) is a constant of the graph, which
nonstrict_trace only takes from outside the compiled region: ``clipped_grad``
is created outside the compiled function and called inside it.

Note [What the loss closes over]
A tensor the body reads that is not among its arguments would be a constant
of the graph, taken as it is at the first compile: Inductor then refuses it
("Please convert all Tensors to FakeTensors first"), and a later change of it
would go unseen. The model's frozen parameters and buffers are such tensors
(a LoRA model's whole base), reached through ``functional_call(model, p, ...)``
or a dict of them the loss closes over. So what the loss closes over is
found when clipped_grad is created (``closed_over``: its closure, the globals
its code names, a partial's function and arguments, a bound method's object
and its attributes, recursively through the user's functions): the modules,
and the closure cells that hold tensors (alone or in lists, tuples, dicts).
Under Dynamo the modules' parameters and buffers and the cells' contents are
read where Dynamo lifts them as inputs of the graph and guards them, and
passed in; the body runs with the modules reparametrized and the cells
filled with them (detached there, once per tensor, so that a tied weight
stays tied). The modules' tree is read at creation (``module_slots``): a
submodule replaced afterwards is not seen by a graph already compiled, so
create clipped_grad again after replacing one. A tensor held elsewhere (a
global, an attribute of another object) stays a constant: aot_eager runs
it, Inductor refuses it, and the traced interception warns of it
(interceptor.py); pass it as an argument.
"""
import contextlib
import functools
import types
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

from torch import Tensor, nn
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.utils._pytree import register_constant, tree_leaves, tree_map

from .._compat import reparametrized
from .._post_import import when_imported

ArgNums = Union[int, Tuple[int, ...]]


class StepSpec:
    """What ``clipped_grad(loss, max_norm, ...)`` fixes: a constant of the
    compiled graph, one per clipped_grad object (compared by identity:
    ``in_dims`` may hold unhashable pytrees)."""

    def __init__(self, loss: Callable[..., Any], max_norm: float, in_dims: Any, argnums: ArgNums,
                 has_aux: bool, randomness: str) -> None:
        self.loss, self.max_norm, self.in_dims = loss, max_norm, in_dims
        self.argnums, self.has_aux, self.randomness = argnums, has_aux, randomness
        # Note [What the loss closes over]
        self.modules, self.cells = closed_over(loss)
        self.slots = tuple(module_slots(m) for m in self.modules)

    # nonstrict_trace guards a constant with ==, and needs it defined.
    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)


register_constant(StepSpec)


_LIBRARIES = ("torch", "functools", "builtins")  # whose functions hold no user state


def closed_over(loss: Callable[..., Any]) -> Tuple[Tuple[nn.Module, ...], Tuple[Any, ...]]:
    """The outermost modules ``loss`` closes over and the closure cells that
    hold tensors (Note [What the loss closes over]), found as the Note says."""
    modules: List[nn.Module] = []
    cells: List[Any] = []
    seen = set()

    def visit(obj: Any) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, nn.Module):
            modules.append(obj)
        elif isinstance(obj, functools.partial):
            for part in (obj.func, *obj.args, *obj.keywords.values()):
                visit(part)
        elif isinstance(obj, types.MethodType):
            owner = obj.__self__
            visit(owner)
            if not isinstance(owner, nn.Module):  # the modules it holds
                for value in getattr(owner, "__dict__", {}).values():
                    visit(value)
            visit(obj.__func__)
        elif isinstance(obj, types.FunctionType) and \
                (obj.__module__ or "").partition(".")[0] not in _LIBRARIES:
            for cell in obj.__closure__ or ():
                try:
                    contents = cell.cell_contents
                except ValueError:  # a cell not yet filled
                    continue
                holds_tensor = any(isinstance(leaf, Tensor) for leaf in tree_leaves(contents))
                if holds_tensor and id(cell) not in seen:  # closures of one scope share cells
                    cells.append(cell)
                seen.add(id(cell))
                visit(contents)
            for name in obj.__code__.co_names:
                if name in obj.__globals__:
                    visit(obj.__globals__[name])

    visit(loss)
    inner = {id(m) for outer in modules for m in outer.modules() if m is not outer}
    return tuple(m for m in modules if id(m) not in inner), tuple(cells)


Slots = Tuple[Tuple[str, Dict[str, Optional[Tensor]]], ...]


def module_slots(module: nn.Module) -> Slots:
    """Where ``module`` keeps its tensors: each submodule's prefix with its
    ``_parameters`` and its ``_buffers`` dict. Dynamo reads these dicts
    without wrapping their modules, which it refuses for RNN, GRU and LSTM,
    and guards their entries, so a parameter replaced later is seen."""
    return tuple((f"{name}." if name else "", slots) for name, m in
                 module.named_modules(remove_duplicate=False) for slots in (m._parameters, m._buffers))


def _detached(tree: Any) -> Any:
    """``tree`` with its tensors detached, one tensor (a tied weight) to one
    detached tensor, so that ties hold where the tensors are swapped in."""
    once: Dict[int, Tensor] = {}
    return tree_map(lambda t: once.setdefault(id(t), t.detach()) if isinstance(t, Tensor) else t,
                    tree)


def closed_over_values(spec: "StepSpec") -> Tuple[Tuple[Dict[str, Tensor], ...], Tuple[Any, ...]]:
    """The modules' parameters and buffers by name and the cells' contents;
    read under Dynamo, which makes their tensors inputs of the graph (a tied
    weight one input under each of its names)."""
    states = tuple({prefix + name: t for prefix, slots in module for name, t in slots.items()
                    if t is not None} for module in spec.slots)
    return states, tuple(cell.cell_contents for cell in spec.cells)


@contextlib.contextmanager
def _filled(cells: Tuple[Any, ...], contents: Tuple[Any, ...]) -> Iterator[None]:
    """The closure cells holding ``contents`` for the block."""
    before = [cell.cell_contents for cell in cells]
    try:
        for cell, value in zip(cells, contents):
            cell.cell_contents = value
        yield
    finally:
        for cell, value in zip(cells, before):
            cell.cell_contents = value


def _run_traced(spec: StepSpec, args: Tuple[Any, ...],
                closed: Tuple[Tuple[Dict[str, Tensor], ...], Tuple[Any, ...]]) -> Any:
    from .transform import clipped_step  # transform.py imports this module

    # the body differentiates its arguments only
    states, contents = _detached(_thawed(closed))
    with reparametrized(spec.modules, states), _filled(spec.cells, contents):
        return clipped_step(spec, _thawed(args), traced=True)


_entry: Optional[Callable[..., Any]] = None


def _register(dynamo: Any) -> None:
    global _entry
    _entry = dynamo.nonstrict_trace(_run_traced)


when_imported("torch._dynamo", _register)


def traced_clipped_grad(spec: StepSpec, args: Tuple[Any, ...]) -> Any:
    """clipped_grad's call while Dynamo traces (Note [clipped_grad under torch.compile])."""
    assert _entry is not None  # Dynamo is imported while it traces
    return _entry(spec, args, closed_over_values(spec))


def _thawed(tree: Any) -> Any:
    """The arguments with Dynamo's immutable containers as plain ones:
    ``functional_call`` updates the dict it is given."""
    if isinstance(tree, immutable_dict):
        return {k: _thawed(v) for k, v in tree.items()}
    if isinstance(tree, immutable_list):
        return [_thawed(v) for v in tree]
    if type(tree) is tuple:
        return tuple(_thawed(v) for v in tree)
    return tree
