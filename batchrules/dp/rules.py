"""The calls clipped_grad handles with a rule, by the function the mode sees: the
layers whose per-sample norms come from (input, output gradient), and the loss
(Note [Losses on physical tensors])."""
from typing import Callable, Dict

import torch
import torch.nn.functional as F

from .attention import intercept_attention
from .conv import intercept_conv
from .embedding import intercept_embedding
from .interceptor import Rule
from .linear import intercept_linear
from .losses import intercept_cross_entropy
from .norm import intercept_layer_norm

RULES: Dict[Callable, Rule] = {
    F.linear: intercept_linear,
    # batchrules.linear under a mode takes its torch.ops entry
    torch.ops.batchrules.linear.default: intercept_linear,
    torch.ops.batchrules.linear: intercept_linear,
    F.conv1d: intercept_conv,
    F.conv2d: intercept_conv,
    F.embedding: intercept_embedding,
    F.multi_head_attention_forward: intercept_attention,
    F.layer_norm: intercept_layer_norm,
    F.cross_entropy: intercept_cross_entropy,
}
