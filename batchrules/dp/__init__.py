"""Differentially private training: per-sample clipping without per-sample gradients."""
from .clipping import EPS
from .transform import clipped_grad

__all__ = ["clipped_grad", "EPS"]
