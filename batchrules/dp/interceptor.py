"""The TorchFunctionMode that sees every torch call of the loss under clipped_grad."""
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from .._compat import current_transform_level, only_vmaps_above
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


class Interceptor(TorchFunctionMode):
    """Routes each torch call of the loss: calls of a function in ``intercepts``
    (rule.py's INTERCEPTS, filled by layers/) made directly at clipped_grad's
    vmap level are handled by its rule, which records a use on the tape; every
    other call that takes a parameter gets per-sample copies instead
    (Note [Per-sample copies]); the rest runs as is.
    """

    def __init__(self, tape: Tape, intercepts: Dict[Callable, Intercept]) -> None:
        super().__init__()
        self.tape = tape
        self.intercepts = intercepts

    def __torch_function__(self, func: Callable, types: Any, args: Tuple[Any, ...] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if not torch.is_grad_enabled() or _is_metadata(func):
            return func(*args, **kwargs)
        intercept = self.intercepts.get(func)
        at_our_level = current_transform_level() == self.tape.level
        if intercept is not None and at_our_level:
            out = intercept(self.tape, args, kwargs)
            if out is not NOT_HANDLED:
                return out
        if (self._holds_param(args) or self._holds_param(tuple(kwargs.values()))) and (
                at_our_level or only_vmaps_above(self.tape.level)):
            # Inside a nested grad/jvp the copy could not be made (functorch
            # cannot wrap a tensor for an outer level there): the parameter
            # is left as is, and the backward reports its use as escaped.
            args = self._substitute(args)
            kwargs = {k: self._substitute(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    def _holds_param(self, items: Sequence[Any]) -> bool:
        for item in items:
            if isinstance(item, Tensor):
                if self.tape.param(item) is not None:
                    return True
            elif isinstance(item, (list, tuple)) and self._holds_param(item):
                return True
        return False

    def _substitute(self, item: Any) -> Any:
        if isinstance(item, Tensor):
            param = self.tape.param(item)
            return item if param is None else self.tape.per_sample_copy(param)
        if isinstance(item, (list, tuple)) and self._holds_param(item):
            values = [self._substitute(i) for i in item]
            # A namedtuple takes its fields as arguments; list, tuple and torch.Size an iterable.
            return type(item)(*values) if hasattr(item, "_fields") else type(item)(values)
        return item
