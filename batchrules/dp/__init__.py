"""Differentially private training: per-sample clipping without per-sample gradients."""
from .._post_import import when_imported as _when_imported
from .clipping import EPS
from .transform import clipped_grad, register_compile_fallback as _register_compile_fallback

_when_imported("torch._dynamo", _register_compile_fallback)

__all__ = ["clipped_grad", "EPS"]
