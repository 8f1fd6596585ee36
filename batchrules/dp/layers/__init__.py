"""The rules clipped_grad intercepts calls with, one file each, registered by
``@register`` (the contract: rule.py): the layers whose per-sample norms come
from (input, output gradient) (recurrent layers' weights among them), the loss (Note [Losses on physical
tensors]), and the calls refused with a clear error (refused.py)."""
from ..rule import INTERCEPTS
from . import (addmm, attention, conv, cross_entropy, embedding, layer_norm,  # noqa: F401
               linear, recurrent, refused)

__all__ = ["INTERCEPTS"]
