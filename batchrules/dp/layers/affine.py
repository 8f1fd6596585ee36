"""What the normalization rules (layer_norm.py, group_norm.py) share: a call
whose parameters are an affine weight and bias, either one optional."""
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from torch import Tensor

from ..rule import Use
from ..tape import Param, Tape, weight_for


@dataclass(eq=False)
class AffineUse(Use):
    """A use whose parameters are ``weight`` and ``bias`` (at least one)."""

    weight: Optional[Param]
    bias: Optional[Param]

    def roles(self) -> Dict[Param, str]:
        return {p: role for p, role in ((self.weight, "weight"), (self.bias, "bias")) if p is not None}


def affine_params(tape: Tape, w: Any, b: Any) -> Optional[Tuple[Optional[Param], Optional[Param]]]:
    """The Params of ``w`` and ``b``; None (not the rule's call) unless at
    least one is given and every one given is a differentiated parameter."""
    weight, bias = tape.param(w), tape.param(b)
    if (weight is None and bias is None) or (w is not None and weight is None) \
            or (b is not None and bias is None):
        return None
    return weight, bias


def affine_operands(tape: Tape, w: Optional[Tensor], b: Optional[Tensor],
                    needs: bool) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """The detached ``w`` and ``b`` the op runs with, one of them through
    ``weight_for`` (the weight, else the bias), so that the output has a node
    to tap when the input needs no grad."""
    w_op = None if w is None else weight_for(tape, w, needs)
    b_op = None if b is None else b.detach() if w is not None else weight_for(tape, b, needs)
    return w_op, b_op
