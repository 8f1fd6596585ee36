"""The recurrence ops' fake kernels (batchrules/recurrent_fakes.py) give every
output's shape, strides and dtype as the kernels allocate them, in every mode
and layout, so that FakeTensor need not run the kernels (which read concrete
sizes, and specialized a compiled step on its batch)."""
from typing import Any, Dict, Optional

import pytest
import torch
from recurrent_reference import one_gate, operands, sample_major
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode

recurrence = torch.ops.batchrules.rnn_recurrence.default
recurrence_backward = torch.ops.batchrules.rnn_recurrence_backward.default


def _config(mode: int, grouped: bool, projected: bool, layout: str, steps: int) -> Dict[str, Any]:
    ops = operands(2 if grouped else 1, 3, 4, P=3 if projected else None, mode=min(mode, 1), seed=1)
    if mode > 1:
        ops = one_gate(ops, 4)
    ops["input_gates"] = ops["input_gates"][:steps]
    if layout == "sample_major":
        ops["input_gates"] = sample_major(ops["input_gates"])
    if not grouped:  # one set of weights: no group dim
        ops = {k: None if v is None else v.squeeze(1 if k == "input_gates" else 0) for k, v in ops.items()}
    return ops


def _same_meta(fake: Optional[Tensor], real: Optional[Tensor]) -> None:
    assert (fake is None) == (real is None)
    if real is not None and fake is not None:
        assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)


CONFIGS = [(mode, grouped, projected, layout, steps)
           for mode in (0, 1, 2, 3) for grouped in (False, True) for projected in (False, True)
           for layout in ("time_major", "sample_major") for steps in (0, 1, 7)
           if not (projected and mode != 0)]


@pytest.mark.parametrize("mode,grouped,projected,layout,steps", CONFIGS)
def test_fakes_match_the_kernels(mode: int, grouped: bool, projected: bool, layout: str,
                                 steps: int) -> None:
    ops = _config(mode, grouped, projected, layout, steps)
    args = (ops["input_gates"], ops["h0"], ops["c0"], ops["w_hh"], ops["b_hh"], ops["w_hr"], mode, False)
    real = recurrence(*args)
    output, h_n, c_n, workspace = real
    grads = (torch.randn_like(output), torch.randn_like(h_n), None if c_n is None else torch.randn_like(c_n))
    backward_args = (*grads, ops["h0"], ops["c0"], ops["w_hh"], ops["w_hr"], output, workspace, mode, False)
    real_backward = recurrence_backward(*backward_args)
    with FakeTensorMode() as fake_mode:
        def fake(t: Any) -> Any:
            return fake_mode.from_tensor(t) if isinstance(t, Tensor) else t
        fakes = recurrence(*map(fake, args))
        fakes_backward = recurrence_backward(*map(fake, backward_args))
    for f, r in zip((*fakes, *fakes_backward), (*real, *real_backward)):
        _same_meta(f, r)


def test_fakes_are_what_faketensor_runs() -> None:
    """Registered as the ops' Meta kernels: FakeTensor runs them, not the C++ loops."""
    for op in (recurrence, recurrence_backward):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta")
