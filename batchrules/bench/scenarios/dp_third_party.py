"""DP-SGD on third-party models (``--full`` only) from configs with random weights,
dropout 0, in training mode (Opacus' hooks record only there): transformers' GPT-2
(tied wte, ``-100`` labels) and BERT (a 4-D additive padding mask), a peft LoRA on
GPT-2's ``c_attn``, torchvision's resnet18 with GroupNorm and a timm ViT. Variants
as in ``dp_step.py`` but no routed vmap(grad) (it times as stock here) and no
compiled twins (compiling a whole GPT-2 takes minutes). A missing model package
skips the row; ghost clipping that refuses the model skips ``opacus_ghost`` with
its error. Targets: clipped_grad <= 1.3x the non-private step (language models at
batch >= 16, resnet18-GN), >= 1.5x faster than Opacus (ghost, or hooks where ghost
cannot run the model), peak memory <= 1.3x the non-private step's.
"""
import copy
import functools
from typing import Callable, Dict, List, NamedTuple, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

import batchrules

from ..baselines.opacus_variants import Reference, opacus_clip_variant, opacus_ghost_variant, with_opacus
from ..case import Case, CaseSetup, Variant
from ..models import in_float64
from ..targets import Speedup, Target
from .dp_step import (
    COMPILED_FASTER,
    COMPILED_NEAR_NONPRIVATE,
    MAX_NORM,
    PEAK_MEMORY,
    clip_and_sum,
    clipped_grad_variant,
    nonprivate_variants,
)

IMAGE_BATCH = 16


class Size(NamedTuple):
    """A transformer's size and its batch."""
    layers: int = 4
    d: int = 256
    heads: int = 4
    tokens: int = 64
    vocab: int = 4096
    batch: int = 16

    @property
    def name(self) -> str:
        return f"l{self.layers}d{self.d}t{self.tokens}_b{self.batch}"


class LmLoss(nn.Module):
    """Per-sample mean cross-entropy of the next tokens, ``-100`` ignored;
    ``reduction`` "sum" sums the samples', "none" returns them (the protocol
    of Opacus' DPLossFastGradientClipping)."""

    def __init__(self) -> None:
        super().__init__()
        self.reduction = "sum"

    def forward(self, logits: Tensor, labels: Tensor) -> Tensor:
        target = labels[..., 1:]
        per_token = F.cross_entropy(logits[..., :-1, :].flatten(0, -2), target.flatten(),
                                    ignore_index=-100, reduction="none").view(target.shape)
        per_sample = per_token.sum(-1) / (target != -100).sum(-1).clamp(min=1)
        return per_sample if self.reduction == "none" else per_sample.sum()


class Logits(nn.Module):
    """``model``'s logits on a tuple of batched inputs (Opacus' modules take one
    input), which ``call`` maps to the model's keyword arguments."""

    def __init__(self, model: nn.Module, call: Callable[..., Tensor]) -> None:
        super().__init__()
        self.model, self.call = model, call

    def forward(self, inputs: Tuple[Tensor, ...]) -> Tensor:
        return self.call(self.model, *inputs)


class Problem(NamedTuple):
    model: nn.Module
    inputs: Tuple[Tensor, ...]
    target: Tensor
    criterion: nn.Module


# Note [Position ids for Opacus]
# transformers builds position (and token type) ids of shape [1, T] when none
# are given, so Opacus' embedding hooks see a batch of 1 and its per-sample
# gradients cannot be stacked; an Opacus user passes them batched, [B, T].
# Built from the ids' shape inside the call: under vmap that is one sample's
# [1, T], a plain tensor (a batched one would reach transformers' data-
# dependent check for packed sequences, which vmap cannot run).
def positions(ids: Tensor) -> Tensor:
    # contiguous: Opacus' ghost norm of an embedding views its indices
    return torch.arange(ids.shape[-1], device=ids.device).expand(ids.shape).contiguous()


def _lm_logits(model: nn.Module, idx: Tensor) -> Tensor:
    return model(input_ids=idx, position_ids=positions(idx), use_cache=False).logits


def gpt2_problem(size: Size, device: torch.device, lora: bool = False) -> Problem:
    """GPT-2, or (``lora``) a peft LoRA on its ``c_attn``; token ids as labels,
    a quarter of the samples' last eighth ``-100``."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model: nn.Module = GPT2LMHeadModel(GPT2Config(
        n_layer=size.layers, n_embd=size.d, n_head=size.heads, vocab_size=size.vocab, n_positions=size.tokens,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    if lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(
            r=8, lora_alpha=16, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0,
            init_lora_weights=False))  # B != 0: A's gradient too
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, size.vocab, (size.batch, size.tokens), generator=gen)
    labels = idx.clone()
    labels[::4, -max(1, size.tokens // 8):] = -100
    return Problem(Logits(model, _lm_logits).to(device), (idx.to(device),), labels.to(device), LmLoss())


def _bert_logits(model: nn.Module, ids: Tensor, mask: Tensor) -> Tensor:
    return model(input_ids=ids, attention_mask=mask, position_ids=positions(ids),
                 token_type_ids=torch.zeros(ids.shape, dtype=torch.long, device=ids.device)).logits


def bert_problem(size: Size, device: torch.device) -> Problem:
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    config = BertConfig(vocab_size=size.vocab, hidden_size=size.d, num_hidden_layers=size.layers,
                        num_attention_heads=size.heads, intermediate_size=4 * size.d,
                        max_position_embeddings=size.tokens, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    model = Logits(BertForSequenceClassification(config), _bert_logits).to(device)
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(size.tokens // 2, size.tokens + 1, (size.batch,), generator=gen)
    keep = torch.arange(size.tokens)[None] < lengths[:, None]
    ids = torch.randint(1, size.vocab, (size.batch, size.tokens), generator=gen).masked_fill(~keep, 0)
    # Note [Padding masks of transformers under clipped_grad] (tests/test_dp_third_party.py):
    # a 4-D additive mask [B, 1, 1, T]
    mask = torch.zeros(size.batch, 1, 1, size.tokens).masked_fill(
        ~keep[:, None, None, :], torch.finfo(torch.float32).min)
    labels = torch.randint(0, 2, (size.batch,), generator=gen)
    return Problem(model, (ids.to(device), mask.to(device)), labels.to(device),
                    nn.CrossEntropyLoss(reduction="sum"))


def _image_logits(model: nn.Module, images: Tensor) -> Tensor:
    return model(images)


def _image_problem(model: nn.Module, device: torch.device) -> Problem:
    gen = torch.Generator().manual_seed(1)
    images = torch.randn(IMAGE_BATCH, 3, 32, 32, generator=gen)
    labels = torch.randint(0, 10, (IMAGE_BATCH,), generator=gen)
    return Problem(Logits(model, _image_logits).to(device), (images.to(device),),
                    labels.to(device), nn.CrossEntropyLoss(reduction="sum"))


def resnet18_gn_problem(device: torch.device) -> Problem:
    from torchvision.models import resnet18
    torch.manual_seed(0)
    # a partial, not a lambda: ResNet keeps its norm_layer, and Opacus pickles the model
    gn = functools.partial(nn.GroupNorm, 2)
    return _image_problem(resnet18(num_classes=10, norm_layer=gn), device)


def vit_problem(device: torch.device) -> Problem:
    from timm.models.vision_transformer import VisionTransformer
    torch.manual_seed(0)
    return _image_problem(VisionTransformer(img_size=32, patch_size=4, embed_dim=256, depth=4,
                                          num_heads=4, num_classes=10), device)


VARIANTS = ("stock", "clipped_grad", "nonprivate", "nonprivate_grad", "opacus_hooks", "opacus_ghost")
# A B = 64 row takes several minutes on 2 CPU cores (the float64 reference and
# Opacus' per-sample vocab-sized gradients).
LM_SIZES = (Size(), Size(batch=64))


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
           reference_of: Reference, setup: CaseSetup) -> List[Variant]:
    """The Opacus ghost variant, or nothing (``opacus_ghost`` marked skipped
    with the error) when it cannot run the model."""
    used = [p for _, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]
    if len(used) > len({id(p) for p in used}):
        setup.skipped["opacus_ghost"] = "Opacus ghost clipping: parameter tying is not supported"
        return []
    try:
        return [opacus_ghost_variant(model, xs, y, copy.deepcopy(criterion), MAX_NORM, reference_of)]
    except Exception as exc:  # noqa: BLE001 (any refusal is reported)
        setup.skipped["opacus_ghost"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        return []


def dp_setup(problem: Problem) -> CaseSetup:
    """The DP variants of the problem; only the parameters that require grad are
    differentiated, the others (and buffers) are held fixed."""
    model, xs, y, criterion = problem
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

    def summed_loss(p: Dict[str, Tensor]) -> Tensor:
        return criterion(functional_call(model, (p, fixed), (xs,)), y)

    def reference_of(m: nn.Module) -> List[Tensor]:
        return _loop_reference(m, xs, y, criterion)

    setup = CaseSetup([
        Variant("stock", vmap_clip, routing=False),
        clipped_grad_variant(clipped, params, *xs, y),
        *nonprivate_variants(summed_loss, params, lambda: criterion(model(xs), y),
                             [p for p in model.parameters() if p.requires_grad],
                             lambda: _summed_reference(model, xs, y, criterion)),
    ], reference=lambda: reference_of(model))
    return with_opacus(setup, ["opacus_hooks", "opacus_ghost"], lambda: [
        opacus_clip_variant(model, xs, y, criterion, MAX_NORM, reference_of),
        *_ghost(model, xs, y, criterion, reference_of, setup)])


def guarded(problem: Callable[[torch.device], Problem],
            setup: Callable[[Problem], CaseSetup] = dp_setup,
            variants: Sequence[str] = VARIANTS) -> Callable[[torch.device], CaseSetup]:
    """The case's build: ``setup`` of the problem, or every variant of
    ``variants`` skipped when its package is missing."""
    def build(device: torch.device) -> CaseSetup:
        try:
            made = problem(device)
        except ImportError as exc:
            why = f"{type(exc).__name__}: {exc}"
            return CaseSetup([], reference=lambda: [], skipped=dict.fromkeys(variants, why))
        return setup(made)
    return build


def targets(near_nonprivate: bool, opacus: str) -> Sequence[Target]:
    """Per row: vs Opacus (``opacus``: the variant that runs the model), peak
    memory, and the step-time target where asked."""
    return [*([Speedup("DP: clipped_grad <= 1.3x the non-private step (nonprivate / clipped_grad "
                       ">= 0.77)", "nonprivate", "clipped_grad", 1 / 1.3)] if near_nonprivate else []),
            *([COMPILED_NEAR_NONPRIVATE] if near_nonprivate else []), COMPILED_FASTER,
            Speedup(f"DP: clipped_grad >= 1.5x faster than Opacus ({opacus})", opacus, "clipped_grad", 1.5),
            PEAK_MEMORY]


def lm_cases(size: Size) -> List[Case]:
    t = f"{size.layers} layers, d={size.d}, {size.tokens} tokens, vocab {size.vocab}, batch {size.batch}"
    near = size.batch >= 16
    return [
        Case("dp_gpt2", size.name, "large", 4 * size.layers + 1,
             f"DP-SGD clipping, transformers GPT-2 (tied wte, -100 labels), {t}",
             guarded(lambda device: gpt2_problem(size, device)), targets(near, "opacus_hooks")),
        Case("dp_bert", size.name, "large", 6 * size.layers + 2,
             f"DP-SGD clipping, transformers BERT classifier, 4-D padding mask, {t}",
             guarded(lambda device: bert_problem(size, device)), targets(near, "opacus_ghost")),
        Case("dp_lora", size.name, "large", 2 * size.layers,
             f"DP-SGD clipping, peft LoRA r=8 on GPT-2 c_attn (only LoRA trained), {t}",
             guarded(lambda device: gpt2_problem(size, device, lora=True)), targets(near, "opacus_ghost")),
    ]


def cases(mode: str) -> List[Case]:
    """The third-party DP rows: --full only."""
    if mode != "full":
        return []
    return [c for size in LM_SIZES for c in lm_cases(size)] + [
        Case("dp_resnet18_gn", f"b{IMAGE_BATCH}", "large", 21,
             f"DP-SGD clipping, torchvision resnet18 GroupNorm(2), 32x32, batch {IMAGE_BATCH}",
             guarded(resnet18_gn_problem), targets(True, "opacus_ghost")),
        Case("dp_vit", f"b{IMAGE_BATCH}", "large", 4 * 4 + 2,
             f"DP-SGD clipping, timm ViT (patch 4, d=256, 4 layers) on 32x32, batch {IMAGE_BATCH}",
             guarded(vit_problem), targets(False, "opacus_ghost"))]
