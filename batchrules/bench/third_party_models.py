"""The third-party models of the DP rows (``scenarios/dp_third_party.py``) from
configs with random weights, dropout 0, in training mode (Opacus' hooks record
only there), each a ``Problem``: the model as a ``Logits`` over a tuple of
batched inputs, the inputs, the targets and a criterion summing the samples'
losses. A missing package raises ImportError when its model is built."""
import functools
from typing import Callable, NamedTuple, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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
    """``model`` called on a tuple of batched inputs, returning its logits
    (Opacus' modules take one input; ``call`` maps the tuple to the model's
    keyword arguments)."""

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


def lm_batch(size: Size, device: torch.device) -> Tuple[Tensor, Tensor]:
    """Token ids and labels, a quarter of the samples' last eighth ``-100``."""
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, size.vocab, (size.batch, size.tokens), generator=gen)
    labels = idx.clone()
    labels[::4, -max(1, size.tokens // 8):] = -100
    return idx.to(device), labels.to(device)


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


def gpt2(size: Size) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(n_layer=size.layers, n_embd=size.d, n_head=size.heads, vocab_size=size.vocab,
                        n_positions=size.tokens, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def gpt2_problem(size: Size, device: torch.device) -> Problem:
    model = Logits(gpt2(size), _lm_logits).to(device)
    idx, labels = lm_batch(size, device)
    return Problem(model, (idx,), labels, LmLoss())


def lora_problem(size: Size, device: torch.device) -> Problem:
    from peft import LoraConfig, get_peft_model
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], fan_in_fan_out=True,
                      lora_dropout=0.0, init_lora_weights=False)  # B != 0: A's gradient too
    model = Logits(get_peft_model(gpt2(size), lora), _lm_logits).to(device)
    idx, labels = lm_batch(size, device)
    return Problem(model, (idx,), labels, LmLoss())


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


def _image_problem(model: nn.Module, device: torch.device, batch: int) -> Problem:
    gen = torch.Generator().manual_seed(1)
    images = torch.randn(batch, 3, 32, 32, generator=gen)
    labels = torch.randint(0, 10, (batch,), generator=gen)
    return Problem(Logits(model, _image_logits).to(device), (images.to(device),),
                    labels.to(device), nn.CrossEntropyLoss(reduction="sum"))


def resnet18_gn_problem(device: torch.device, batch: int = IMAGE_BATCH) -> Problem:
    from torchvision.models import resnet18
    torch.manual_seed(0)
    # a partial, not a lambda: ResNet keeps its norm_layer, and Opacus pickles the model
    gn = functools.partial(nn.GroupNorm, 2)
    return _image_problem(resnet18(num_classes=10, norm_layer=gn), device, batch)


def vit_problem(device: torch.device, batch: int = IMAGE_BATCH) -> Problem:
    from timm.models.vision_transformer import VisionTransformer
    torch.manual_seed(0)
    return _image_problem(VisionTransformer(img_size=32, patch_size=4, embed_dim=256, depth=4,
                                          num_heads=4, num_classes=10), device, batch)
