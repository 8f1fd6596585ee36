"""batchrules: ``linear`` as a first-class citizen of ``torch.func``.

Importing the package loads the C++ extension, which registers the operators
``torch.ops.batchrules.linear`` and ``torch.ops.batchrules.linear_backward``
with explicit autograd formulas and vmap batching rules.
"""
import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C  # noqa: F401  (registers the operators)
from .ops import linear, linear_backward
from .routing import disable, enable, enabled, is_enabled

__all__ = ["linear", "linear_backward", "enable", "disable", "enabled", "is_enabled"]

__version__ = "0.1.0"
