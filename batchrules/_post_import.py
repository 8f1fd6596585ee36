"""Run a callback once a module has been imported, without importing it.

Note [Registering with optional torch subsystems lazily]
The DTensor sharding strategies need ``torch.distributed.tensor``, whose import
costs about half a second, which ``import batchrules`` must not pay for users
who never touch DTensor. So the registration runs right after that module's
own import finishes, whoever triggers it: now if it is already imported,
otherwise from a ``sys.meta_path`` finder that wraps the module's loader.
"""
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import warnings
from types import ModuleType
from typing import Callable, Dict, List, Optional, Sequence

Callback = Callable[[ModuleType], None]

_lock = threading.Lock()
_pending: Dict[str, List[Callback]] = {}


class _CallbackLoader(importlib.abc.Loader):
    """Delegates to the real loader, then runs the pending callbacks."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # The module's own code runs with the real loader as __loader__.
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        with _lock:
            callbacks = _pending.pop(module.__name__, [])
        for callback in callbacks:
            # A failing registration must not break the user's own import.
            try:
                callback(module)
            except Exception as e:  # noqa: BLE001
                warnings.warn(f"batchrules: setup after importing {module.__name__} failed: {e!r}",
                              stacklevel=2)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self._searching = threading.local()

    def find_spec(self, fullname: str, path: Optional[Sequence[str]],
                  target: Optional[ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname not in _pending or getattr(self._searching, "name", None) == fullname:
            return None
        # Find the real spec with the other finders (this one steps aside).
        self._searching.name = fullname
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._searching.name = None
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _CallbackLoader(spec.loader)
        return spec


_finder = _PostImportFinder()


def when_imported(module_name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once ``module_name`` is imported: now if it
    already is, otherwise right after its import completes."""
    with _lock:
        module = sys.modules.get(module_name)
        if module is None:
            _pending.setdefault(module_name, []).append(callback)
            if _finder not in sys.meta_path:
                sys.meta_path.insert(0, _finder)
            return
    callback(module)
