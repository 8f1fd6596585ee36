"""The rules clipped_grad intercepts calls with, one file each, registered by
``@register`` (the contract: rule.py): the layers whose per-sample norms come
from (input, output gradient), and the loss (Note [Losses on physical
tensors])."""
from ..rule import INTERCEPTS
from . import addmm, attention, conv, cross_entropy, embedding, layer_norm, linear  # noqa: F401

__all__ = ["INTERCEPTS"]
