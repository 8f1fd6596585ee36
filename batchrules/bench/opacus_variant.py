"""The Opacus variant of per-sample-gradient scenarios (GradSampleModule hooks)."""
import copy
import importlib
import warnings
from typing import Callable, List, Optional

import torch
from torch import Tensor, nn

from .case import Variant


def opacus_missing_reason() -> Optional[str]:
    """None when Opacus can be used, else a note saying why the variant is skipped."""
    try:
        importlib.import_module("opacus")
    except ImportError as exc:
        return (
            f"opacus not importable ({exc}); the opacus rows are skipped. "
            "Install it with `pip install opacus` (its deps are scipy and opt_einsum; "
            "check with --dry-run that it leaves torch alone)"
        )
    return None


def opacus_variant(
    model: nn.Module, x: Tensor, y: Tensor, loss_sum: Callable[[Tensor, Tensor], Tensor]
) -> Optional[Variant]:
    """Per-sample gradients the Opacus way: forward the batch, backward a summed
    loss, read ``p.grad_sample``. ``loss_sum`` must reduce by sum, so that each
    sample's gradient is that of its own loss. None when Opacus is missing."""
    if opacus_missing_reason() is not None:
        return None
    from opacus import GradSampleModule

    module = GradSampleModule(copy.deepcopy(model), batch_first=True, loss_reduction="sum")
    params: List[nn.Parameter] = [p for p in module.parameters() if p.requires_grad]

    def step() -> List[Tensor]:
        with warnings.catch_warnings():
            # The hooks fire on module outputs because x needs no grad: intended.
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            loss_sum(module(x), y).backward()
        grads = [p.grad_sample for p in params]
        # Release the module's references so that, as for the other variants,
        # the caller holds the only copy of the result between steps.
        for p in params:
            p.grad_sample = None
            p.grad = None
        return grads

    return Variant("opacus", step)


def cross_entropy_sum(out: Tensor, target: Tensor) -> Tensor:
    return torch.nn.functional.cross_entropy(out, target, reduction="sum")
