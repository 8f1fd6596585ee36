"""Per-sample losses on physical tensors.

Note [Losses on physical tensors]
The loss is a per-sample function under vmap, and vmap runs F.cross_entropy
through functorch's Python decomposition of nll_loss (gather, where, a
division, and a scatter in the backward): several ms per step at batch 128
on CPU, more than clipped_grad's own work on an MLP. At clipped_grad's level
the rule below computes every sample's loss at once instead: one
``F.cross_entropy(..., reduction="none")`` over the folded batch, then each
sample's sum, or its mean over its non-ignored targets (what the "mean"
reduction divides by). Configurations outside that (class weights,
probability targets, label smoothing) keep the vmap path.
"""
import math
from typing import Any, Dict, Tuple

import torch
import torch.nn.functional as F

from ..rule import NOT_HANDLED, Rule, batched, bind, physical, register
from ..tape import Tape

_CROSS_ENTROPY_ARGS = (("input", "target", "weight", "size_average", "ignore_index", "reduce",
                        "reduction", "label_smoothing"), (None, None, -100, None, "mean", 0.0))


@register
class CrossEntropyRule(Rule):
    """Note [Losses on physical tensors]."""

    functions = (F.cross_entropy,)

    @classmethod
    def intercept(cls, tape: Tape, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        bound = bind(*_CROSS_ENTROPY_ARGS, args, kwargs)
        if bound is None:
            return NOT_HANDLED
        x, target, weight, size_average, ignore_index, reduce, reduction, smoothing = bound
        if (weight is not None or size_average is not None or reduce is not None or smoothing != 0.0
                or reduction not in ("mean", "sum") or not isinstance(target, torch.Tensor)
                or target.dtype != torch.int64 or type(ignore_index) is not int):
            return NOT_HANDLED
        logits, labels = physical(tape, x), physical(tape, target)
        if logits is None or labels is None or not logits.is_floating_point():
            return NOT_HANDLED
        batch, shape, label_shape = logits.shape[0], logits.shape[1:], labels.shape[1:]
        if len(shape) == 1:  # one [C] prediction, a 0-d label
            if label_shape != ():
                return NOT_HANDLED
            flat_logits, flat_labels = logits, labels
        elif len(shape) >= 2 and label_shape == shape[:1] + shape[2:]:
            flat_logits = logits.reshape(batch * shape[0], *shape[1:])
            flat_labels = labels.reshape(batch * shape[0], *label_shape[1:])
        else:
            return NOT_HANDLED  # F.cross_entropy reports the mismatch
        losses = F.cross_entropy(flat_logits, flat_labels, ignore_index=ignore_index,
                                 reduction="none")
        per_sample = losses.view(batch, losses.numel() // batch if batch else 0).sum(1)
        if reduction == "mean":
            counted = (labels.reshape(batch, math.prod(label_shape)) != ignore_index).sum(1)
            per_sample = per_sample / counted.to(per_sample.dtype)
        return batched(tape, per_sample)
