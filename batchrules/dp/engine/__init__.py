"""DP-SGD in the user's own training loop: ``loss.backward(); optimizer.step()``."""
from .module import PrivateModule
from .optimizer import DPOptimizer

__all__ = ["PrivateModule", "DPOptimizer"]
