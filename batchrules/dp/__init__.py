"""Differentially private training: per-sample clipping without per-sample gradients."""
from .chunks import clipped_grad_chunked
from .clipping import EPS
from .engine import BatchMemoryManager, DPDataLoader, PrivacyEngine
from .sharded import all_reduce_flat, reduce_scatter_flat, unsharded
from .transform import clipped_grad

__all__ = ["clipped_grad", "EPS", "clipped_grad_chunked", "all_reduce_flat", "reduce_scatter_flat",
           "unsharded", "PrivacyEngine", "BatchMemoryManager", "DPDataLoader"]
