"""The Opacus variants: per-sample gradients (GradSampleModule hooks) and DP-SGD clipping."""
import copy
import importlib
import warnings
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..case import CaseSetup, Variant


def opacus_missing_reason() -> Optional[str]:
    """None when Opacus can be used, else why its variants are skipped."""
    try:
        importlib.import_module("opacus")
    except ImportError as exc:
        return f"opacus not importable ({exc})"
    return None


def with_opacus(setup: CaseSetup, names: Sequence[str], build: Callable[[], List[Variant]]) -> CaseSetup:
    """Adds the Opacus variants ``build`` makes or, when Opacus is missing, marks
    ``names`` skipped with the reason."""
    reason = opacus_missing_reason()
    if reason is None:
        setup.variants.extend(build())
    else:
        setup.skipped.update(dict.fromkeys(names, reason))
    return setup


def _hooked_backward(loss: Tensor, params: Iterable[Any]) -> List[Tensor]:
    """``loss.backward()`` through Opacus' hooks, then each parameter's ``grad_sample``,
    dropped from it so that the caller holds the only copy of the result. (The hooks
    fire on module outputs as the input needs no grad; torch warns on every step.)"""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        loss.backward()
    grads = []
    for p in params:
        grads.append(p.grad_sample)
        p.grad_sample = p.grad = None
    return grads


def opacus_variant(model: nn.Module, x: Tensor, y: Tensor) -> Variant:
    """Per-sample gradients the Opacus way: forward the batch, backward the summed
    cross-entropy (each sample's gradient is that of its own loss), read ``p.grad_sample``."""
    from opacus import GradSampleModule
    module = GradSampleModule(copy.deepcopy(model), batch_first=True, loss_reduction="sum")
    params = [p for p in module.parameters() if p.requires_grad]
    return Variant("opacus", lambda: _hooked_backward(cross_entropy_sum(module(x), y), params))


def opacus_encoder_variant(model: nn.Module, seq_first: nn.Module, x: Tensor, y: Tensor) -> Variant:
    """Per-sample gradients of a batch-first nn.TransformerEncoderLayer ``model``
    with Opacus' DPMultiheadAttention (ModuleValidator.fix), the split q/k/v
    gradients concatenated back into in_proj's layout. Runs ``seq_first``, the
    layer built with batch_first=False, holding ``model``'s weights: Opacus 1.6's
    DPMultiheadAttention with batch_first=True merges the heads in the wrong order."""
    from opacus import GradSampleModule
    from opacus.validators import ModuleValidator
    seq_first.load_state_dict(model.state_dict())
    fixed = ModuleValidator.fix(seq_first)
    module = GradSampleModule(fixed, batch_first=False, loss_reduction="sum")
    mha = fixed.self_attn
    split_w = [mha.qlinear.weight, mha.klinear.weight, mha.vlinear.weight]
    split_b = [mha.qlinear.bias, mha.klinear.bias, mha.vlinear.bias]
    ordered = [mha.out_proj.weight, mha.out_proj.bias, fixed.linear1.weight, fixed.linear1.bias,
               fixed.linear2.weight, fixed.linear2.bias, fixed.norm1.weight, fixed.norm1.bias,
               fixed.norm2.weight, fixed.norm2.bias]
    x_t, y_t = x.transpose(0, 1), y.transpose(0, 1)  # T, B, d

    def step() -> List[Tensor]:
        # per-sample mean squared error, summed: each sample's gradient is its own
        w_q, w_k, w_v, b_q, b_k, b_v, *grads = _hooked_backward(
            (module(x_t) - y_t).pow(2).mean(dim=(0, 2)).sum(), [*split_w, *split_b, *ordered])
        return [torch.cat([w_q, w_k, w_v], dim=1), torch.cat([b_q, b_k, b_v], dim=1), *grads]

    return Variant("opacus", step)


def cross_entropy_sum(out: Tensor, target: Tensor) -> Tensor:
    return torch.nn.functional.cross_entropy(out, target, reduction="sum")


# ---- DP-SGD clipping (scenarios/dp_step.py) --------------------------------------------------

class _ClonedOutput(nn.Module):
    """``norm``, its output cloned (see _opacus_ready)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.cloned_output_of = norm

    def forward(self, x: Tensor) -> Tensor:
        return self.cloned_output_of(x).clone()


Reference = Callable[[nn.Module], List[Tensor]]


def _opacus_ready(model: nn.Module, reference_of: Reference
                  ) -> Tuple[nn.Module, Callable[[List[Tensor]], List[Tensor]], Optional[Callable[[], Any]]]:
    """A copy of the model as an Opacus user trains it: ModuleValidator.fix swaps
    the layers Opacus cannot hook (nn.MultiheadAttention's packed in-projection
    becomes q/k/v linears), and no hooked layer's output is modified in place,
    which the hooks refuse (torchvision's ResNet adds the residual into a
    GroupNorm's output, then applies ReLU(inplace=True)). Also returns the map to
    the model's parameter order, and the variant's own reference (None: the case's)."""
    from opacus.validators import ModuleValidator
    fixed = ModuleValidator.fix(copy.deepcopy(model))
    for module in fixed.modules():
        if getattr(module, "inplace", False) is True:
            module.inplace = False
    for parent in list(fixed.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, nn.GroupNorm):
                setattr(parent, child_name, _ClonedOutput(child))
    names = [n.replace(".cloned_output_of.", ".") for n, p in fixed.named_parameters() if p.requires_grad]

    def to_model_order(grads: List[Tensor]) -> List[Tensor]:
        by_name = dict(zip(names, grads))
        out = []
        for name, p in model.named_parameters():
            if not p.requires_grad:  # frozen (LoRA's base model): no gradient
                continue
            if name in by_name:
                out.append(by_name[name])
            else:  # in_proj_weight / in_proj_bias -> q, k, v linears
                prefix, kind = name.rsplit(".", 1)
                part = kind.replace("in_proj_", "")
                out.append(torch.cat([by_name[f"{prefix}.{q}linear.{part}"] for q in "qkv"]))
        return out

    # Where ModuleValidator.fix changed the model it computes another function
    # (DPMultiheadAttention with batch_first=True, see opacus_encoder_variant).
    changed = [n for n, _ in fixed.named_parameters()] != [n for n, _ in model.named_parameters()]
    pristine = copy.deepcopy(fixed) if changed else model  # before Opacus' hooks are attached

    def reference() -> List[Tensor]:
        *sums, norms = reference_of(pristine)
        return [*to_model_order(sums), norms]

    return fixed, to_model_order, reference if changed else None


def opacus_clip_variant(
    model: nn.Module, x: Any, y: Tensor, loss_sum: Callable[[Tensor, Tensor], Tensor],
    max_norm: float, reference_of: Reference,
) -> Variant:
    """``opacus_hooks``: GradSampleModule's per-sample gradients, then the
    clipping of Opacus' DPOptimizer.clip_and_accumulate (norm over all
    parameters, factor min(1, C / (norm + 1e-6)), einsum). Returns the clipped
    sums and the norms."""
    from opacus import GradSampleModule
    fixed, to_model_order, reference = _opacus_ready(model, reference_of)
    module = GradSampleModule(fixed, batch_first=True, loss_reduction="sum")
    params = [p for p in module.parameters() if p.requires_grad]

    def step() -> List[Tensor]:
        samples = _hooked_backward(loss_sum(module(x), y), params)
        norms = torch.stack([g.reshape(len(g), -1).norm(2, dim=-1) for g in samples], 1).norm(2, dim=1)
        factor = (max_norm / (norms + 1e-6)).clamp(max=1.0)
        return [*to_model_order([torch.einsum("i,i...", factor, g) for g in samples]), norms]

    return Variant("opacus_hooks", step, reference=reference)


def opacus_ghost_variant(
    model: nn.Module, x: Any, y: Tensor, criterion_sum: nn.Module, max_norm: float,
    reference_of: Reference,
) -> Variant:
    """``opacus_ghost``: what ``make_private(..., grad_sample_mode="ghost")``
    runs, whose ``backward()`` is two backward passes (norms from the hooks, then
    the loss reweighted by the clipping factors). Returns the clipped sums (the
    parameters' ``.grad``, no noise) and the norms."""
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
    fixed, to_model_order, reference = _opacus_ready(model, reference_of)
    module = GradSampleModuleFastGradientClipping(
        fixed, batch_first=True, loss_reduction="sum", max_grad_norm=max_norm,
        use_ghost_clipping=True)
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = DPOptimizerFastGradientClipping(
        torch.optim.SGD(params, lr=0.0), noise_multiplier=0.0, max_grad_norm=max_norm,
        expected_batch_size=y.shape[0], loss_reduction="sum")
    criterion = DPLossFastGradientClipping(module, optimizer, criterion_sum, loss_reduction="sum")

    def step() -> List[Tensor]:
        with warnings.catch_warnings():  # as in _hooked_backward
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            criterion(module(x), y).backward()
        sums = [p.grad for p in params]
        for p in params:
            p.grad = None
        return [*to_model_order(sums), module.per_sample_gradient_norms]

    return Variant("opacus_ghost", step, reference=reference)
