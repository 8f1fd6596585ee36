"""DP-SGD in the user's own training loop: ``loss.backward(); optimizer.step()``,
with Opacus' names: ``PrivacyEngine`` makes the model (``PrivateModule``), the
optimizer (``DPOptimizer``) and the data loader (``DPDataLoader``, Poisson
sampling) private; ``BatchMemoryManager`` runs logical batches in physical pieces."""
from .batch_memory_manager import BatchMemoryManager
from .data_loader import DPDataLoader
from .module import PrivateModule
from .optimizer import DPOptimizer
from .privacy_engine import PrivacyEngine

__all__ = ["BatchMemoryManager", "DPDataLoader", "DPOptimizer", "PrivacyEngine", "PrivateModule"]
