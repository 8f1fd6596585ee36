"""How clipped_grad sees the loss's calls that take a differentiated tensor.

Note [Intercepting only the calls that take a parameter]
Each differentiated leaf reaches the loss as a ``Differentiated``: the same
storage and autograd leaf, as a tensor subclass whose ``__torch_function__``
routes every torch call taking it (as an argument, in a list of tensors, or
as ``self`` of a method) to the active ``Interceptor``. Calls that take no
parameter (activations, reshapes, the loss, attention on activations) never
leave C++: clipped_grad adds nothing to them beyond what vmap itself costs.
A TorchFunctionMode would also see those, each through Python dispatch, a
cost that would grow with the model's ops rather than its layers. The
price: a rule can only intercept calls that take a parameter (a layer rule's
weight, BatchNorm's affine parameters), and a BatchNorm in training mode
without affine parameters is refused by torch's own checks under vmap (as
under ``vmap(grad)``) rather than by clipped_grad's message.

Note [Intercepting while traced]
A traced step (Note [clipped_grad under torch.compile] in compiled_step.py)
cannot use the subclass: make_fx's proxy mode refuses any tensor type it does
not know, and FakeTensors cannot be re-wrapped as another subclass. There the
leaves are plain tensors and the Interceptor is reached through an
``InterceptingMode`` instead, which finds the leaves among a call's arguments
by identity. That the mode sees every call costs only while tracing.
"""
import threading
import warnings
from typing import Any, Callable, ContextManager, Dict, Iterable, Optional, Tuple

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from .. import routing
from .._compat import current_transform_level, only_vmaps_above
from .batched_forward import per_sample_call
from .rule import NOT_HANDLED, Intercept
from .tape import Tape

# Tensor properties that are differentiable views (the rest are metadata).
_VIEW_PROPERTIES = frozenset({"T", "mT", "H", "mH", "real", "imag"})
# Tensor methods that only read metadata or leave autograd (never substituted).
_METADATA_METHODS = frozenset({
    "dim", "ndimension", "size", "numel", "nelement", "stride", "storage_offset",
    "is_contiguous", "is_floating_point", "is_complex", "is_signed", "element_size",
    "get_device", "data_ptr", "untyped_storage", "__len__", "__format__", "__repr__",
    "__hash__", "detach", "is_inference", "has_names", "is_set_to", "is_shared",
})


def _is_metadata(func: Callable) -> bool:
    name = getattr(func, "__name__", None)
    if name == "__get__":  # a property: func is the getter of a getset_descriptor
        return getattr(getattr(func, "__self__", None), "__name__", None) not in _VIEW_PROPERTIES
    return name in _METADATA_METHODS


class _Active(threading.local):
    interceptor: Optional["Interceptor"] = None


_active = _Active()


class Differentiated(Tensor):
    """A differentiated leaf as the loss sees it (Note [Intercepting only the
    calls that take a parameter]). Outside clipped_grad's forward it behaves
    as a plain tensor; results of calls are plain tensors."""

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: Tuple[Any, ...] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        # Rules and the generic path work on plain tensors: no re-entry here.
        with torch._C.DisableTorchFunctionSubclass():
            interceptor = _active.interceptor
            if interceptor is None:
                return func(*args, **kwargs)
            return interceptor.handle(func, args, kwargs)


def intercepted_leaf(leaf: Tensor, traced: bool = False) -> Tensor:
    """A detached ``Differentiated`` leaf that requires grad, sharing ``leaf``'s
    storage (``_make_subclass`` detaches it); a plain one for a traced step
    (Note [Intercepting while traced])."""
    if traced:
        return leaf.detach().requires_grad_()
    return Tensor._make_subclass(Differentiated, leaf, True)


class InterceptingMode(TorchFunctionMode):
    """Routes the calls that take one of ``interceptor``'s leaves to it; the
    others run as they are (Note [Intercepting while traced])."""

    def __init__(self, interceptor: "Interceptor") -> None:
        super().__init__()
        self.interceptor = interceptor

    def __torch_function__(self, func: Callable, types: Any, args: Tuple[Any, ...] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        _warn_of_constants(func, args, kwargs)
        interceptor = self.interceptor
        if interceptor.holds_param(args) or interceptor.holds_param(kwargs.values()):
            return interceptor.handle(func, args, kwargs)
        return func(*args, **kwargs)


def _warn_of_constants(func: Callable, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    """Warns of a real tensor among a traced call's fake ones: one the loss
    reads but is not given, a constant of the compiled graph (Note [What the
    loss closes over] in compiled_step.py)."""
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
    fake = [is_fake(t) for t in tensors]
    if any(fake) and not all(fake):
        t = tensors[fake.index(False)]
        warnings.warn(
            f"clipped_grad under torch.compile: the loss reads a tensor it is not given (shape "
            f"{tuple(t.shape)}, {t.dtype}, in {getattr(func, '__name__', func)}): the graph takes it "
            "as a constant, as it is now, and Inductor refuses it (\"Please convert all Tensors to "
            "FakeTensors first\"). Pass it as an argument, or hold it in the loss's closure or in a "
            "module the loss closes over", stacklevel=2)


class Interceptor:
    """While entered (in this thread), routes each call that takes a
    ``Differentiated`` of ``tape``: a call of a function in ``intercepts``
    (rule.py's INTERCEPTS, filled by layers/) made directly at clipped_grad's
    vmap level is handled by its rule, which records a use on the tape; any
    other gets per-sample copies of the parameters it takes (Note [Per-sample
    copies] in tape.py).
    """

    def __init__(self, tape: Tape, intercepts: Dict[Callable, Intercept], traced: bool = False) -> None:
        self.tape = tape
        self.intercepts = intercepts
        self._outer: Optional[Interceptor] = None
        self._mode = InterceptingMode(self) if traced else None
        self._routing: Optional[ContextManager[None]] = None

    def __enter__(self) -> "Interceptor":
        self._outer, _active.interceptor = _active.interceptor, self
        if self._mode is not None:
            self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._mode is not None:
                self._mode.__exit__(*exc)
        finally:
            _active.interceptor = self._outer
            scope, self._routing = self._routing, None
            if scope is not None:
                scope.__exit__(None, None, None)

    def _routed(self) -> None:
        """Routing on from the engine's first per-call vmap to ``__exit__``
        (Note [Routing only for the per-call vmaps] in batched_forward.py)."""
        if self._routing is None:
            self._routing = routing.enabled()
            self._routing.__enter__()

    def handle(self, func: Callable, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if not torch.is_grad_enabled() or _is_metadata(func):
            return func(*args, **kwargs)
        if self.tape.batched:  # the engine's
            if current_transform_level() is not None:  # the model's own transform: its leaves escape
                return func(*args, **kwargs)
            return per_sample_call(self.tape, self._at_level, self._routed, func, args, kwargs)
        return self._at_level(func, args, kwargs)

    def _at_level(self, func: Callable, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        at_our_level = current_transform_level() == self.tape.level
        intercept = self.intercepts.get(func)
        if intercept is not None and at_our_level:
            out = intercept(self.tape, args, kwargs)
            if out is not NOT_HANDLED:
                return out
        if at_our_level or only_vmaps_above(self.tape.level):
            # Inside a nested grad/jvp the copy could not be made (functorch
            # cannot wrap a tensor for an outer level there): the parameter
            # is left as is, and the backward reports its use as escaped.
            args = self._substitute(args)
            kwargs = {k: self._substitute(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    def holds_param(self, items: Iterable[Any]) -> bool:
        for item in items:
            if isinstance(item, Tensor):
                if self.tape.param(item) is not None:
                    return True
            elif isinstance(item, (list, tuple)) and self.holds_param(item):
                return True
        return False

    def _substitute(self, item: Any) -> Any:
        if isinstance(item, Tensor):
            param = self.tape.param(item)
            return item if param is None else self.tape.per_sample_copy(param)
        if isinstance(item, (list, tuple)) and self.holds_param(item):
            values = [self._substitute(i) for i in item]
            # A namedtuple takes its fields as arguments; list, tuple and torch.Size an iterable.
            return type(item)(*values) if hasattr(item, "_fields") else type(item)(values)
        return item
