"""clipped_grad on third-party models, as a user builds the per-sample loss:
transformers' GPT-2 (Conv1D through torch.addmm, the tied wte, ``-100``
labels) and BERT with padding, a peft LoRA on GPT-2, torchvision's resnet18
with GroupNorm and a timm ViT. All from configs with random weights (no
downloads), in float64, against the materialized reference
(``vmap(grad(loss))``, clipped and summed); each test also checks the kind
every parameter took (a layer silently falling back to per-sample copies
fails here) and that clipped_grad ran no slow vmap fallback. The packages are
optional: a missing one skips its test with the import error (the
``requires`` marker, conftest.py).
"""
import warnings
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple, Type

import pytest
import torch
import torch.nn.functional as F
from dp_reference import clip_coef, materialized_clipped_grad, per_sample_norms
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

import batchrules

REL = 1e-9
VOCAB = 97
# vmap's warnings when an op has no batching rule and runs sample by sample.
SLOW_PATH = ("falling back to the slow path", "There is a performance drop")
# Each layer type's (weight kind, bias kind) (clipping.py).
Layer = Tuple[Type[nn.Module], str, Optional[str]]
LAYER_KINDS: Tuple[Layer, ...] = (
    (nn.Linear, "linear", "bias"), (nn.Conv2d, "conv", "bias"), (nn.Embedding, "embedding", None),
    (nn.LayerNorm, "materialized", "bias"), (nn.GroupNorm, "materialized", "bias"))


def expected_kinds(model: nn.Module, names: Iterable[str],
                   layers: Sequence[Layer] = ()) -> Dict[str, str]:
    """The kind of each named parameter from the layers that use it: "tied"
    for one used by layers of different kinds (GPT-2's wte and lm_head),
    "materialized" for one of no listed layer (used by plain tensor ops: a
    ViT's cls_token and pos_embed)."""
    by_id = {id(p): name for name, p in model.named_parameters()}
    seen: Dict[str, set] = {}
    for module in model.modules():
        for cls, weight_kind, bias_kind in (*layers, *LAYER_KINDS):
            if isinstance(module, cls):
                for role, k in (("weight", weight_kind), ("bias", bias_kind)):
                    p = getattr(module, role, None)
                    if isinstance(p, nn.Parameter) and id(p) in by_id:
                        seen.setdefault(by_id[id(p)], set()).add(k)
                break
    return {n: "materialized" if n not in seen else seen[n].pop() if len(seen[n]) == 1 else "tied"
            for n in names}


def check(loss, args: Tuple[Any, ...], in_dims: Tuple[Any, ...]) -> None:
    """clipped_grad of ``loss`` (differentiating ``args[0]``) against the
    materialized reference, with max_norm the median norm (some samples
    clipped, some not); no slow-path warning."""
    with warnings.catch_warnings():  # the reference may run the slow path
        warnings.filterwarnings("ignore", "There is a performance drop")
        per = vmap(grad(loss), in_dims=in_dims)(*args)
    norms = per_sample_norms(per)
    max_norm = norms.median().item()
    want, _ = materialized_clipped_grad(per, max_norm)
    coef = clip_coef(norms, max_norm)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, got_norms = batchrules.clipped_grad(loss, max_norm, in_dims=in_dims)(*args)
    slow = [str(w.message) for w in caught if any(s in str(w.message) for s in SLOW_PATH)]
    assert not slow, slow
    assert (coef < 1).any() and (coef == 1).any()
    torch.testing.assert_close(got_norms, norms, rtol=REL, atol=0)
    assert got.keys() == want.keys()
    # A gradient that is zero up to rounding (an attention key's bias: softmax
    # ignores a shift) is compared against the largest one.
    largest = max(w.abs().max().item() for w in want.values())
    for k, w in want.items():
        err = (got[k] - w).abs().max().item()
        assert got[k].dtype == w.dtype and err <= REL * max(w.abs().max().item(), 1e-6 * largest), \
            f"{k}: max abs error {err:.3g} vs scale {w.abs().max().item():.3g}"


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                        eos_token_id=0)
    return GPT2LMHeadModel(config)


def lm_batch(batch: int, rows: int) -> Tuple[Tensor, Tensor]:
    """Token ids and labels, some ``-100`` (ignored)."""
    torch.manual_seed(1)
    idx = torch.randint(0, VOCAB, (batch, rows))
    labels = idx.clone()
    labels[0, :3] = -100
    labels[2, -2:] = -100
    return idx, labels


def buffers(model: nn.Module) -> Dict[str, Tensor]:
    return dict(model.named_buffers())


# Note [Padding masks of transformers under clipped_grad]
# transformers turns a 2-D ``attention_mask`` ([N, T] of 0/1) into SDPA's mask
# in masking_utils, which first asks ``padding_mask.all()`` (to drop an
# all-ones mask), with SDPA as with eager attention: data-dependent control
# flow, which no vmap can run ("vmap: It looks like you're attempting to use a
# Tensor in some data-dependent control flow"), so vmap(grad) fails on it as
# clipped_grad does. A 4-D additive float mask (0 where attended, a large
# negative where not) is taken as is, in place of the mask transformers would
# build: ``[N, 1, 1, T]`` for an encoder (BERT), ``[N, 1, T, T]`` with the
# causal part for a decoder (GPT-2). README.md gives this workaround.
def additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """0 where ``allowed``, the dtype's lowest value elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


@pytest.mark.requires("transformers")
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded_4d_mask"])
def test_gpt2(kinds, clip_shapes, padded: bool) -> None:
    from transformers.pytorch_utils import Conv1D
    model = gpt2().double().eval()
    params = {k: v.detach() for k, v in model.named_parameters()}
    state = buffers(model)

    def loss(p: Dict[str, Tensor], idx: Tensor, labels: Tensor, *mask: Tensor) -> Tensor:
        masks = {"attention_mask": mask[0][None]} if mask else {}
        out = functional_call(model, (p, state), (idx[None],),
                              {"labels": labels[None], "use_cache": False, "return_dict": True,
                               **masks})
        return out.loss

    batch, rows = 4, 8
    idx, labels = lm_batch(batch, rows)
    args: Tuple[Any, ...] = (params, idx, labels)
    if padded:  # right padding, labels -100 there; the causal and padding mask [B, 1, T, T]
        keep = torch.ones(batch, rows, dtype=torch.bool)
        keep[1, 5:] = keep[3, 2:] = False
        labels.masked_fill_(~keep, -100)
        causal = torch.ones(rows, rows, dtype=torch.bool).tril()
        args += (additive_mask(causal & keep[:, None, None, :], torch.float64),)
    check(loss, args, (None,) + (0,) * (len(args) - 1))
    assert kinds == expected_kinds(model, params, [(Conv1D, "addmm", "bias")])
    assert kinds["transformer.wte.weight"] == "tied"
    # Neither the embedding's [B, V, d] (or [B*V, d]) nor the lm_head's per-sample gradient.
    table = params["transformer.wte.weight"].numel()
    formed = [s for s in clip_shapes if torch.Size(s).numel() % table == 0
              and torch.Size(s).numel() > table]
    assert not formed, formed


@pytest.mark.requires("transformers")
def test_bert_with_padding(kinds) -> None:
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
                        num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(config).double().eval()
    params = {k: v.detach() for k, v in model.named_parameters()}
    state = buffers(model)
    batch, rows = 4, 8
    keep = torch.ones(batch, rows, dtype=torch.bool)
    keep[0, 5:] = keep[2, 3:] = False
    idx = torch.randint(1, VOCAB, (batch, rows)).masked_fill(~keep, 0)
    # Note [Padding masks of transformers under clipped_grad]: [B, 1, 1, T]
    mask = additive_mask(keep[:, None, None, :], torch.float64)
    labels = torch.randint(0, 3, (batch,))

    def loss(p: Dict[str, Tensor], ids: Tensor, m: Tensor, label: Tensor) -> Tensor:
        out = functional_call(model, (p, state), (ids[None],), {
            "attention_mask": m[None], "labels": label[None], "return_dict": True})
        return out.loss

    # The mask masks: other ids at sample 0's padded positions leave its loss unchanged.
    repadded = idx[0].masked_fill(~keep[0], 5)
    torch.testing.assert_close(loss(params, repadded, mask[0], labels[0]),
                               loss(params, idx[0], mask[0], labels[0]), rtol=1e-12, atol=0)
    check(loss, (params, idx, mask, labels), (None, 0, 0, 0))
    assert kinds == expected_kinds(model, params)


@pytest.mark.requires("transformers", "peft")
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_peft_lora_on_gpt2(kinds) -> None:
    """Only the LoRA factors differentiated; the frozen base model passed as an
    unbatched argument that is not differentiated."""
    from peft import LoraConfig, get_peft_model
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True,
                      lora_dropout=0.0, init_lora_weights=False)  # B != 0: A's gradient too
    model = get_peft_model(gpt2(), lora).double().eval()
    trained = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    frozen = {k: v.detach() for k, v in model.named_parameters() if not v.requires_grad}
    frozen.update(buffers(model))
    assert trained and all("lora_" in k for k in trained)

    def loss(p: Dict[str, Tensor], base: Dict[str, Tensor], idx: Tensor, labels: Tensor) -> Tensor:
        out = functional_call(model, (p, base), (idx[None],),
                              {"labels": labels[None], "use_cache": False, "return_dict": True})
        return out.loss

    check(loss, (trained, frozen, *lm_batch(4, 8)), (None, None, 0, 0))
    assert kinds == {k: "linear" for k in trained}


def check_image_model(model: nn.Module, batch: int) -> Dict[str, Tensor]:
    """``check`` on 32x32 images, 10 classes; returns the parameters."""
    model = model.double().eval()
    params = {k: v.detach() for k, v in model.named_parameters()}
    state = buffers(model)

    def loss(p: Dict[str, Tensor], image: Tensor, label: Tensor) -> Tensor:
        return F.cross_entropy(functional_call(model, (p, state), (image[None],)), label[None])

    torch.manual_seed(1)
    images = torch.randn(batch, 3, 32, 32, dtype=torch.float64)
    check(loss, (params, images, torch.randint(0, 10, (batch,))), (None, 0, 0))
    return params


@pytest.mark.slow  # 11M parameters: the reference's per-sample gradients, in float64
@pytest.mark.requires("torchvision")
def test_torchvision_resnet18_group_norm(kinds) -> None:
    from torchvision.models import resnet18
    torch.manual_seed(0)
    model = resnet18(num_classes=10, norm_layer=lambda channels: nn.GroupNorm(2, channels))
    params = check_image_model(model, batch=3)
    assert kinds == expected_kinds(model, params)


@pytest.mark.requires("timm")
def test_timm_vit(kinds) -> None:
    """vit_tiny_patch16_224's architecture, shrunk: fused attention (SDPA),
    a patch-embedding convolution, cls_token and pos_embed (plain tensor ops)."""
    from timm.models.vision_transformer import VisionTransformer
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2,
                              num_classes=10)
    params = check_image_model(model, batch=4)
    assert kinds == expected_kinds(model, params)
    assert kinds["cls_token"] == kinds["pos_embed"] == "materialized"
