"""The rules clipped_grad intercepts calls with, one file each, registered by
``@register`` (the contract: rule.py): the layers whose per-sample norms come
from (input, output gradient) (recurrent layers' weights among them), and
the calls refused with a clear error (refused.py). A rule sees only calls
that take a parameter (Note [Intercepting only the calls that take a
parameter] in interceptor.py); the loss runs under vmap with routing's C++
batching rules for aten's loss kernels."""
from ..rule import INTERCEPTS
from . import (  # noqa: F401
    addmm,
    attention,
    conv,
    embedding,
    group_norm,
    layer_norm,
    linear,
    recurrent,
    refused,
)

__all__ = ["INTERCEPTS"]
