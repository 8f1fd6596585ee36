"""How ``torch.compile`` sees batchrules: every compile hook, in one place.

- ``batchrules.linear``'s C entry is traced as the operator it stands for
  (``register_linear_polyfill``);
- AOTAutograd decomposes the batchrules operators (``register_decompositions``,
  below);
- the recurrence ops have fake kernels that keep a batch symbolic
  (``recurrent_fakes.py``);
- ``clipped_grad`` is one opaque call to Dynamo that AOTAutograd traces
  through (Note [clipped_grad under torch.compile] in dp/compiled_step.py).

``install()`` (run by ``import batchrules``) registers the first three; the
Dynamo parts wait for ``torch._dynamo``'s import (Note [Registering with
optional torch subsystems lazily]), which is slow.

Decompositions
--------------
Dynamo needs nothing from us: the kernels are CompositeExplicitAutograd and
SymInt-aware, so FakeTensor (static or dynamic shapes) runs the real C++ kernel,
shape checks included, and AOTAutograd traces through the C++ autograd nodes.
What remains is the choice of what the backend receives:

* extern kernel: ``batchrules::linear`` / ``linear_backward`` stay opaque calls
  in the graph (what happens with no registration at all);
* decomposition: below autograd the ops become the aten ops their kernels
  call (``aten.linear`` -> ``addmm``/``mm``; the backward -> two ``mm`` +
  ``sum``; ``silu``/``mish`` and their backward -> ``aten.silu``,
  ``aten.silu_backward``, ...), so Inductor sees plain GEMMs it can fuse
  around and pick templates for, and pointwise ops it fuses.

We decompose. Timed on a compiled training step (fwd + bwd) of a 3-layer
ReLU MLP both ways against compiled ``F.linear`` (numbers: docs/design.md's
decision table), decomposed is as fast as compiled ``F.linear`` and beats extern where launches and memory
passes count (small sizes): the backward's bias-gradient sums fuse into the
preceding pointwise kernels (9 instead of 11 kernels for the 3-layer
backward). The graph is the one Inductor gets for ``F.linear``, so GPU GEMM
templates (max-autotune), epilogue fusion and pattern passes apply
unchanged; an extern call is a fusion barrier.

Note [Decomposing under FunctionalTensorMode]
The decomposition is a ``torch.library.register_torch_dispatch`` rule for
``FunctionalTensorMode``, the mode AOTAutograd traces under (the mechanism
``torch.library.triton_op`` uses). The rule runs the op's own
CompositeExplicitAutograd C++ kernel with the mode active, so the aten ops that
kernel calls are what gets traced: the decomposition is the eager kernel by
construction (every bias quirk and shape check included), with nothing
written twice. Unlike an entry in Inductor's decomposition table it needs no
import of ``torch._inductor`` (slow) when batchrules is imported, it is in
place before any compilation, and every AOTAutograd backend (``aot_eager``
included) sees the same graph. Eager code, FakeTensor and Dynamo still call
the op itself.
Consequences: ``torch.export.export`` keeps ``batchrules.linear`` in its
(pre-dispatch) graph and ``ExportedProgram.run_decompositions()`` lowers it to
``addmm``. Compile caches are keyed on the Dynamo graph, which does not show
the decomposition: changed kernels (a batchrules upgrade) are only seen in
compiled code after clearing Inductor's cache directory.
"""
from types import ModuleType
from typing import Any, Optional, Tuple

import torch
from torch import Tensor
from torch._C import DispatchKey
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

from . import _C
from ._post_import import when_imported
from .activations import ACTIVATIONS
from .recurrent_fakes import register_recurrence_fakes

# Every batchrules operator: each has a CompositeExplicitAutograd kernel to trace.
OPS: Tuple[str, ...] = ("batchrules::linear", "batchrules::linear_backward") + tuple(
    f"batchrules::{name}{suffix}" for name in ACTIVATIONS for suffix in ("", "_backward"))


def install() -> None:
    """The compile hooks of ``import batchrules``: the decompositions now, the
    linear polyfill once ``torch._dynamo`` is imported."""
    register_decompositions()
    register_recurrence_fakes()
    when_imported("torch._dynamo", register_linear_polyfill)


def register_linear_polyfill(dynamo: ModuleType) -> None:
    """Has torch.compile trace the C entry of ``batchrules.linear`` as the
    operator it stands for (Note [Eager entry of batchrules.linear] in
    csrc/python_module.cpp)."""
    linear = torch.ops.batchrules.linear.default

    @dynamo.substitute_in_graph(_C.linear, skip_signature_check=True)
    def _linear_polyfill(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        return linear(input, weight, bias)


def _plain(types: Tuple[type, ...]) -> bool:
    # Tensor subclasses other than the tracing ones (e.g. DTensor) get their own
    # __torch_dispatch__ first; it calls back here with plain tensors.
    return all(t in (Tensor, FunctionalTensor) or issubclass(t, FakeTensor) for t in types)


def _trace_kernel(mode: FunctionalTensorMode, func: Any, types: Tuple[type, ...], args: tuple,
                  kwargs: dict) -> Any:
    """See Note [Decomposing under FunctionalTensorMode]."""
    if not _plain(types):
        return NotImplemented
    with mode:
        return func._op_dk(DispatchKey.CompositeExplicitAutograd, *args, **kwargs)


_library: Optional[torch.library.Library] = None


def register_decompositions() -> None:
    """Make AOTAutograd decompose the batchrules ops (done by ``import batchrules``;
    idempotent)."""
    global _library
    if _library is not None:
        return
    library = torch.library.Library("batchrules", "FRAGMENT")
    for qualname in OPS:
        torch.library.register_torch_dispatch(qualname, FunctionalTensorMode, _trace_kernel,
                                              lib=library)
    _library = library


def unregister_decompositions() -> None:
    """Let compiled graphs call the ops as extern kernels instead (for comparisons).

    Compiled code already cached (in process, or Inductor's on-disk caches)
    keeps what it was compiled with: reset Dynamo and disable the caches when
    switching."""
    global _library
    # Dropping the last reference runs the Library's finalizer, which removes
    # its registrations.
    _library = None


def decompositions_registered() -> bool:
    """Whether AOTAutograd currently decomposes the batchrules ops."""
    return _library is not None
