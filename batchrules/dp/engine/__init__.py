"""DP-SGD in the user's own training loop: ``loss.backward(); optimizer.step()``,
with Opacus' names: ``PrivateModule`` and ``DPOptimizer``, Poisson sampling
(``DPDataLoader``) and logical batches in physical pieces (``BatchMemoryManager``)."""
from .batch_memory_manager import BatchMemoryManager
from .data_loader import DPDataLoader
from .module import PrivateModule
from .optimizer import DPOptimizer

__all__ = ["BatchMemoryManager", "DPDataLoader", "DPOptimizer", "PrivateModule"]
