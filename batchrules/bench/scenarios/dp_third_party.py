"""DP-SGD on third-party models (``--full`` only, ``third_party_models.py``):
transformers' GPT-2 (tied wte, ``-100`` labels) and BERT (a 4-D additive padding
mask), a peft LoRA on GPT-2's ``c_attn``, torchvision's resnet18 with GroupNorm
and a timm ViT. Variants as in ``dp_step.py`` but no routed vmap(grad) (it times
as stock here) and no compiled twins (compiling a whole GPT-2 takes minutes). A
missing model package skips the row; ghost clipping that refuses the model
skips ``opacus_ghost`` with its error. Targets: clipped_grad <= 1.3x the
non-private step (language models at batch >= 16, resnet18-GN), >= 1.5x faster
than Opacus (ghost, or hooks where ghost cannot run the model) and peak memory
<= 1.3x the non-private step's.
"""
import copy
from typing import Callable, Dict, List, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

import batchrules

from .. import third_party_models as models
from ..baselines.opacus_variants import opacus_clip_variant, opacus_ghost_variant, with_opacus
from ..case import Case, CaseSetup, Variant
from ..models import in_float64
from ..targets import Speedup, Target
from .dp_step import MAX_NORM, PEAK_MEMORY, clip_and_sum, clipped_grad_variant

VARIANTS = ("stock", "clipped_grad", "nonprivate", "opacus_hooks", "opacus_ghost")
MID = models.Size()
# (size, modes): a B = 64 row takes several minutes on 2 CPU cores (the float64
# reference and Opacus' per-sample vocab-sized gradients).
SIZES = ((MID, {"full"}), (MID._replace(batch=64), {"full"}))


def _float64(t: Tensor) -> Tensor:
    return t.cpu().double() if t.is_floating_point() else t.cpu()


def _loop_reference(model: nn.Module, xs: Tuple[Tensor, ...], y: Tensor,
                    criterion: nn.Module) -> List[Tensor]:
    """float64: one backward per sample, then clip and sum."""
    m64 = in_float64(model)
    params = [p for p in m64.parameters() if p.requires_grad]
    xs64 = tuple(_float64(x) for x in xs)
    rows = [torch.autograd.grad(criterion(m64(tuple(x[i:i + 1] for x in xs64)), y[i:i + 1].cpu()),
                                params) for i in range(len(y))]
    return clip_and_sum({str(k): torch.stack(col) for k, col in enumerate(zip(*rows))}, MAX_NORM)


def _summed_reference(model: nn.Module, xs: Tuple[Tensor, ...], y: Tensor,
                      criterion: nn.Module) -> List[Tensor]:
    m64 = in_float64(model)
    loss = criterion(m64(tuple(_float64(x) for x in xs)), y.cpu())
    return list(torch.autograd.grad(loss, [p for p in m64.parameters() if p.requires_grad]))


def _ghost(model: nn.Module, xs: Tuple[Tensor, ...], y: Tensor, criterion: nn.Module,
           setup: CaseSetup) -> List[Variant]:
    """The Opacus ghost variant, or nothing (``opacus_ghost`` marked skipped
    with the error) when it cannot run the model."""
    used = [p for _, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]
    if len(used) > len({id(p) for p in used}):
        setup.skipped["opacus_ghost"] = "Opacus ghost clipping: parameter tying is not supported"
        return []
    try:
        return [opacus_ghost_variant(model, xs, y, copy.deepcopy(criterion), MAX_NORM,
                                     lambda m: _loop_reference(m, xs, y, criterion))]
    except Exception as exc:  # noqa: BLE001 (any refusal is reported)
        setup.skipped["opacus_ghost"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        return []


def dp_setup(problem: models.Problem) -> CaseSetup:
    """The DP variants of the problem's model (a ``Logits``) on its batched
    inputs and targets; its criterion sums over samples. Only the
    parameters that require grad are differentiated, the others (and buffers)
    are held fixed."""
    model, xs, y, criterion = problem
    trainable = [p for p in model.parameters() if p.requires_grad]
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    fixed = {k: v.detach() for k, v in model.named_parameters() if not v.requires_grad}
    fixed.update(model.named_buffers())
    in_dims = (None,) + (0,) * (len(xs) + 1)

    def sample_loss(p: Dict[str, Tensor], *args: Tensor) -> Tensor:
        *inputs, target = args
        out = functional_call(model, (p, fixed), (tuple(x.unsqueeze(0) for x in inputs),))
        return criterion(out, target.unsqueeze(0))

    per_sample_grads = vmap(grad(sample_loss), in_dims=in_dims)
    clipped = batchrules.clipped_grad(sample_loss, MAX_NORM, in_dims=in_dims)

    def vmap_clip() -> List[Tensor]:
        return clip_and_sum(per_sample_grads(params, *xs, y), MAX_NORM)

    def nonprivate() -> List[Tensor]:
        return list(torch.autograd.grad(criterion(model(xs), y), trainable))

    setup = CaseSetup([
        Variant("stock", vmap_clip, routing=False),
        clipped_grad_variant(clipped, params, *xs, y),
        Variant("nonprivate", nonprivate, reference=lambda: _summed_reference(model, xs, y, criterion)),
    ], reference=lambda: _loop_reference(model, xs, y, criterion))
    return with_opacus(setup, ["opacus_hooks", "opacus_ghost"], lambda: [
        opacus_clip_variant(model, xs, y, criterion, MAX_NORM,
                            lambda m: _loop_reference(m, xs, y, criterion)),
        *_ghost(model, xs, y, criterion, setup)])


def guarded(problem: Callable[[torch.device], models.Problem]) -> Callable[[torch.device], CaseSetup]:
    """The case's build: ``dp_setup`` of the problem, or every variant skipped
    when its package is missing."""
    def build(device: torch.device) -> CaseSetup:
        try:
            made = problem(device)
        except ImportError as exc:
            why = f"{type(exc).__name__}: {exc}"
            return CaseSetup([], reference=lambda: [], skipped=dict.fromkeys(VARIANTS, why))
        return dp_setup(made)
    return build


def targets(near_nonprivate: bool, opacus: str) -> Sequence[Target]:
    """Per row: vs Opacus (``opacus``: the variant that runs the model), peak
    memory, and the step-time target where asked."""
    return [*([Speedup("DP: clipped_grad <= 1.3x the non-private step (nonprivate / clipped_grad "
                       ">= 0.77)", "nonprivate", "clipped_grad", 1 / 1.3)] if near_nonprivate else []),
            Speedup(f"DP: clipped_grad >= 1.5x faster than Opacus ({opacus})", opacus, "clipped_grad", 1.5),
            PEAK_MEMORY]


def lm_cases(size: models.Size) -> List[Case]:
    t = f"{size.layers} layers, d={size.d}, {size.tokens} tokens, vocab {size.vocab}, batch {size.batch}"
    near = size.batch >= 16
    return [
        Case("dp_gpt2", size.name, "large", 4 * size.layers + 1,
             f"DP-SGD clipping, transformers GPT-2 (tied wte, -100 labels), {t}",
             guarded(lambda device: models.gpt2_problem(size, device)), targets(near, "opacus_hooks")),
        Case("dp_bert", size.name, "large", 6 * size.layers + 2,
             f"DP-SGD clipping, transformers BERT classifier, 4-D padding mask, {t}",
             guarded(lambda device: models.bert_problem(size, device)), targets(near, "opacus_ghost")),
        Case("dp_lora", size.name, "large", 2 * size.layers,
             f"DP-SGD clipping, peft LoRA r=8 on GPT-2 c_attn (only LoRA trained), {t}",
             guarded(lambda device: models.lora_problem(size, device)), targets(near, "opacus_ghost")),
    ]


def cases(mode: str) -> List[Case]:
    """The third-party DP rows: --full only."""
    if mode != "full":
        return []
    return [c for size, modes in SIZES if mode in modes for c in lm_cases(size)] + [
        Case("dp_resnet18_gn", f"b{models.IMAGE_BATCH}", "large", 21,
             f"DP-SGD clipping, torchvision resnet18 GroupNorm(2), 32x32, batch {models.IMAGE_BATCH}",
             guarded(models.resnet18_gn_problem), targets(True, "opacus_ghost")),
        Case("dp_vit", f"b{models.IMAGE_BATCH}", "large", 4 * 4 + 2,
             f"DP-SGD clipping, timm ViT (patch 4, d=256, 4 layers) on 32x32, batch {models.IMAGE_BATCH}",
             guarded(models.vit_problem), targets(False, "opacus_ghost"))]
