"""Refuse to load a C++ extension built for another torch.

Runs when imported, which ``import batchrules`` does before loading the extension: an extension
compiled against one torch can fail to load against another (an undefined
symbol) or, worse, load and misbehave, because libtorch's C++ ABI changes with
every release. setup.py records the torch it compiled against in
``batchrules/_build_info.py`` (see Note [Building against the installed torch]
in setup.py); a missing record or a different torch is an ImportError that
says how to rebuild.
"""
import importlib
import os
import sys
from types import ModuleType
from typing import Optional

import torch

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def rebuild_command(info: Optional[ModuleType]) -> str:
    """The one command that rebuilds the extension for the running torch."""
    in_place = info is None or info.IN_PLACE
    # An in-place build is imported from its checkout: rebuild where it is now
    # (it may have moved since); otherwise from the checkout it was built in.
    source = info.SOURCE_DIR if info is not None and not in_place else os.path.dirname(_PACKAGE_DIR)
    if os.path.isfile(os.path.join(source, "setup.py")):
        return f"pip install --no-build-isolation {'-e ' if in_place else ''}{source}"
    # A wheel whose checkout is gone (or was on another machine).
    return "pip install --no-build-isolation <path of a batchrules checkout>"


def _load_record() -> Optional[ModuleType]:
    # The record must sit next to this package's extension. (A plain import could
    # find another checkout's: setuptools' editable-install finder resolves
    # batchrules.* submodules in the installed checkout when this one lacks them.)
    if not os.path.isfile(os.path.join(_PACKAGE_DIR, "_build_info.py")):
        return None
    return importlib.import_module(f"{__package__}._build_info")


def mismatch(info: ModuleType) -> Optional[str]:
    """Why the recorded build does not fit the running interpreter and torch, or None."""
    installed = str(torch.__version__)
    if info.TORCH_VERSION != installed:
        return f"it was built for torch {info.TORCH_VERSION}, but torch {installed} is installed"
    if info.TORCH_GIT_VERSION != torch.version.git_version:
        return (f"it was built for torch {installed} at commit {info.TORCH_GIT_VERSION}, but the "
                f"installed torch {installed} is commit {torch.version.git_version}")
    python = "%d.%d" % sys.version_info[:2]
    if info.PYTHON_VERSION != python:
        return f"it was built for Python {info.PYTHON_VERSION}, but this is Python {python}"
    return None


def check_build() -> None:
    """Raise ImportError unless the extension was built for the running torch."""
    info = _load_record()
    if info is None:
        raise ImportError(
            f"batchrules: the C++ extension has not been built for {_PACKAGE_DIR} (its build "
            "record, batchrules/_build_info.py, is missing). Build it against the installed "
            f"torch {torch.__version__} with:\n    {rebuild_command(None)}")
    reason = mismatch(info)
    if reason is not None:
        raise ImportError(
            f"batchrules: the C++ extension does not match this environment: {reason}. A C++ "
            "extension only works with the exact torch it was compiled against. Rebuild it "
            f"with:\n    {rebuild_command(info)}")


check_build()  # on import: ``import batchrules`` imports this module before the extension
