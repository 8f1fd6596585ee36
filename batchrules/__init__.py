"""batchrules: the ops of a training step as first-class citizens of ``torch.func``.

Importing the package loads the C++ extension, which registers the operators
``torch.ops.batchrules.linear`` / ``linear_backward`` and, for each activation
(``silu``, ``mish``, ...), ``<name>`` / ``<name>_backward``, with explicit
autograd formulas and vmap batching rules, plus vmap batching rules for aten's
loss and scaled-dot-product-attention kernels. ``enable()`` routes
``F.linear``, the activations (``F.silu``, ``F.mish``, ...) and attention to
them under torch.func transforms; ``clipped_grad`` is the DP-SGD transform
(per-sample clipped gradient sums).
"""
import torch  # noqa: F401  (loads libtorch before the extension)

# isort: split
# Importing it refuses an extension built for another torch, before _C loads.
from . import _build_check  # noqa: F401

# isort: split
from . import _C  # noqa: F401  (registers the operators)
from ._post_import import when_imported as _when_imported
from .activations import *  # noqa: F401, F403  (silu, silu_backward, mish, ...)
from .activations import __all__ as _activation_entries
from .compile import install as _install_compile_hooks
from .dp import clipped_grad
from .ensemble import ensemble_vmap
from .linear import linear, linear_backward
from .routing import disable, enable, enabled, is_enabled


def _register_sharding_strategies(_module: object) -> None:
    from .distributed import register_sharding_strategies

    register_sharding_strategies()


_install_compile_hooks()
_when_imported("torch.distributed.tensor", _register_sharding_strategies)

__all__ = ["linear", "linear_backward", *_activation_entries, "clipped_grad", "ensemble_vmap", "enable",
           "disable", "enabled", "is_enabled"]

__version__ = "0.1.0"
