"""Differences between the torch releases batchrules supports, in one place.

Each function here wraps one internal of torch whose location or behaviour
changed between releases; callers never reach into those internals directly.
"""


def load_functorch_vmap_decompositions() -> None:
    """Have functorch register its Python vmap decompositions now.

    functorch registers them on ``FuncTorchBatched`` at the first vmap call, and
    the newest registration of a kernel wins; batchrules' routed batching rules
    for the same aten ops must come after them (Note [Routing aten ops only
    while transforms are active]).
    """
    from torch._functorch.vmap import lazy_load_decompositions

    lazy_load_decompositions()


def dispatch_has_kernel(qualified_name: str, dispatch_key: str) -> bool:
    """Whether ``qualified_name`` (``"aten::op"``) has a kernel of its own for
    ``dispatch_key`` (a fallback does not count): e.g. whether functorch has a
    batching rule (``"FuncTorchBatched"``)."""
    import torch

    return torch._C._dispatch_has_kernel_for_dispatch_key(qualified_name, dispatch_key)
