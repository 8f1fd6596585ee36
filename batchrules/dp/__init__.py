"""Differentially private training: per-sample clipping without per-sample gradients."""
from .transform import clipped_grad
from .clipping import EPS

__all__ = ["clipped_grad", "EPS"]
