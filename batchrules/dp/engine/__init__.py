"""DP-SGD in the user's own training loop, with Opacus' names: Poisson sampling
(``DPDataLoader``) and logical batches in physical pieces (``BatchMemoryManager``)."""
from .batch_memory_manager import BatchMemoryManager
from .data_loader import DPDataLoader

__all__ = ["BatchMemoryManager", "DPDataLoader"]
