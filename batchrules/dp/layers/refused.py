"""Calls clipped_grad refuses, before they run, with an error naming the call
and its parameters (vmap's own errors there name neither).
"""
from typing import Any, Dict, Tuple

import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

from ..rule import NOT_HANDLED, Rule, bind, register
from ..tape import Tape

_BATCH_NORM_ARGS = (("input", "running_mean", "running_var", "weight", "bias", "training",
                     "momentum", "eps"), (None, None, False, 0.1, 1e-5))


def _params(tape: Tape, items: Any) -> str:
    names = [p.name for t in tree_flatten(items)[0] for p in [tape.param(t)] if p is not None]
    return ", ".join(names)


@register
class BatchNormTrainingRule(Rule):
    """``F.batch_norm(training=True)`` with running statistics and affine
    parameters (the calls a rule sees: Note [Intercepting only the calls that
    take a parameter]): its statistics and their update mix the samples of
    the batch. The running statistics stay untouched (nn.BatchNorm has
    already counted the batch in ``num_batches_tracked``, as under vmap(grad))."""

    functions = (F.batch_norm,)

    @classmethod
    def intercept(cls, tape: Tape, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        bound = bind(*_BATCH_NORM_ARGS, args, kwargs)
        if bound is None:
            return NOT_HANDLED
        x, mean, var, w, b, training = bound[:6]
        params = _params(tape, (w, b))
        if not training or (mean is None and var is None) or not params:
            return NOT_HANDLED  # eval mode, or per-sample statistics only: vmap runs it
        raise RuntimeError(
            f"clipped_grad: a BatchNorm in training mode (F.batch_norm with running statistics, "
            f"parameters {params}) on per-sample input of shape "
            f"{tuple(x.shape)}: its statistics mix the samples of a batch, so per-sample "
            "gradients are not defined, and its running statistics would be updated per sample. "
            "Call model.eval(), use GroupNorm or LayerNorm, or track_running_stats=False")
