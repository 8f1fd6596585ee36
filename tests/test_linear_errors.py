"""Bad input to batchrules.linear / linear_backward: a clear RuntimeError that
names the op and the shapes (or dtypes / devices), never a crash, in eager,
on meta, and with autograd or forward-mode AD recording."""
import re
from typing import Callable, List, Tuple

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from linear_samples import opinfo_error_inputs

import batchrules

cpu, meta = torch.device("cpu"), torch.device("meta")


# Where aten checks the same thing, its message comes first ("mat1 and mat2
# shapes cannot be multiplied (2x3 and 5x4); batchrules.linear: ...").
ATEN_FIRST = "^(?:[^;]*; )?"


def test_aten_messages_come_first(routing_on) -> None:
    """What F.linear says eagerly starts the routed message too (per-example
    shapes under vmap)."""
    x, w = torch.randn(2, 3), torch.randn(4, 5)
    with pytest.raises(RuntimeError, match=r"^mat1 and mat2 shapes cannot be multiplied \(2x3 and 5x4\)"):
        F.linear(x, w)
    with pytest.raises(RuntimeError, match=r"^mat1 and mat2 shapes cannot be multiplied \(2x3 and 5x4\); "):
        torch.func.vmap(F.linear, (0, None))(x.expand(7, 2, 3), w)
    w64 = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"^expected m1 and m2 to have the same dtype, but got: "
                                           r"float != double; "):
        torch.func.grad(lambda t: F.linear(t, w64).sum())(x)


def t(*shape: int, dtype: torch.dtype = torch.float32, device: torch.device = cpu) -> torch.Tensor:
    return torch.randn(shape, dtype=dtype, device=device)


# (name, thunk building the arguments, regex the message must match)
LINEAR_ERRORS: List[Tuple[str, Callable[[], tuple], str]] = [
    ("0-d input", lambda: (t(), t(4, 3)),
     r"both input and weight need to be at least 1-D, but got input of shape \[\] and weight of "
     r"shape \[4, 3\]"),
    ("0-d weight", lambda: (t(3), t()),
     r"at least 1-D, but got input of shape \[3\] and weight of shape \[\]"),
    ("3-d weight", lambda: (t(2, 3), t(2, 4, 3)),
     r"weight must be 1-D \(in_features\) or 2-D \(out_features, in_features\), but got weight "
     r"of shape \[2, 4, 3\]"),
    ("in_features mismatch", lambda: (t(2, 3), t(4, 5)),
     r"input and weight shapes cannot be multiplied \(input \[2, 3\] and weight \[4, 5\]\)"),
    ("in_features mismatch 1-d weight", lambda: (t(7, 2, 3), t(4)),
     r"cannot be multiplied \(input \[7, 2, 3\] and weight \[4\]\)"),
    ("bias not broadcastable", lambda: (t(2, 3), t(4, 3), t(5)),
     r"bias of shape \[5\] cannot be broadcast to the output shape \[2, 4\] of input \[2, 3\] "
     r"and weight \[4, 3\]"),
    ("bias enlarges output", lambda: (t(2, 3), t(4, 3), t(3, 2, 4)),
     r"bias of shape \[3, 2, 4\] cannot be broadcast to the output shape \[2, 4\]"),
    ("bias of flattened rows", lambda: (t(2, 4, 3), t(5, 3), t(8, 1)),
     r"bias of shape \[8, 1\] cannot be broadcast to the output shape \[2, 4, 5\]"),
    ("bias on 1-d output", lambda: (t(3), t(3), t(2)),
     r"bias of shape \[2\] cannot be broadcast to the output shape \[\]"),
    ("bias with 2-d input and 1-d weight", lambda: (t(2, 3), t(3), t()),
     r"a bias is not supported for 2-D input with 1-D weight \(input \[2, 3\], weight \[3\], "
     r"bias \[\]\)"),
    ("weight dtype", lambda: (t(2, 3), t(4, 3, dtype=torch.float64)),
     r"expected input and weight to have the same dtype, but got input Float and weight Double"),
    ("bias dtype", lambda: (t(2, 3), t(4, 3), t(4, dtype=torch.float16)),
     r"expected input and bias to have the same dtype, but got input Float and bias Half"),
    ("0-d bias dtype", lambda: (t(2, 3), t(4, 3), t(dtype=torch.float64)),
     r"expected input and bias to have the same dtype, but got input Float and bias Double"),
    ("complex weight", lambda: (t(2, 3), t(4, 3, dtype=torch.complex64)),
     r"same dtype, but got input Float and weight ComplexFloat"),
    ("integer input", lambda: (t(2, 3).long(), t(4, 3)),
     r"same dtype, but got input Long and weight Float"),
    ("weight on meta", lambda: (t(2, 3), t(4, 3, device=meta)),
     r"expected input and weight to be on the same device, but got input on cpu and weight on "
     r"meta"),
    ("input on meta", lambda: (t(2, 3, device=meta), t(4, 3)),
     r"same device, but got input on meta and weight on cpu"),
    ("bias on meta", lambda: (t(2, 3), t(4, 3), t(4, device=meta)),
     r"expected input and bias to be on the same device, but got input on cpu and bias on meta"),
    ("1-d cpu bias with meta operands", lambda: (t(2, 3, device=meta), t(4, 3, device=meta), t(4)),
     r"same device, but got input on meta and bias on cpu"),
    ("shape error wins over dtype error", lambda: (t(2, 3), t(4, 5, dtype=torch.float64)),
     r"cannot be multiplied \(input \[2, 3\] and weight \[4, 5\]\)"),
]

LINEAR_BACKWARD_ERRORS: List[Tuple[str, Callable[[], tuple], str]] = [
    ("grad_output features", lambda: (t(2, 3), t(2, 5), t(4, 3)),
     r"grad_output of shape \[2, 5\] does not match the output shape \[2, 4\] of linear with "
     r"input \[2, 3\] and weight \[4, 3\]"),
    ("grad_output rank", lambda: (t(2, 3), t(4), t(4, 3)),
     r"grad_output of shape \[4\] does not match the output shape \[2, 4\]"),
    ("grad_output broadcastable but not equal", lambda: (t(2, 3), t(1, 4), t(4, 3)),
     r"grad_output of shape \[1, 4\] does not match the output shape \[2, 4\]"),
    ("grad_output for 1-d weight", lambda: (t(2, 3), t(2, 1), t(3)),
     r"grad_output of shape \[2, 1\] does not match the output shape \[2\]"),
    ("0-d self", lambda: (t(), t(4), t(4, 3)),
     r"both input and weight need to be at least 1-D, but got input of shape \[\]"),
    ("3-d weight", lambda: (t(2, 3), t(2, 4), t(2, 4, 3)),
     r"weight of shape \[2, 4, 3\]"),
    ("in_features mismatch", lambda: (t(2, 3), t(2, 4), t(4, 5)),
     r"cannot be multiplied \(input \[2, 3\] and weight \[4, 5\]\)"),
    ("weight dtype", lambda: (t(2, 3), t(2, 4), t(4, 3, dtype=torch.float64)),
     r"expected self and weight to have the same dtype, but got self Float and weight Double"),
    ("grad_output dtype", lambda: (t(2, 3), t(2, 4, dtype=torch.float64), t(4, 3)),
     r"expected self and grad_output to have the same dtype, but got self Float and grad_output "
     r"Double"),
    ("grad_output on meta", lambda: (t(2, 3), t(2, 4, device=meta), t(4, 3)),
     r"expected self and grad_output to be on the same device, but got self on cpu and "
     r"grad_output on meta"),
    ("weight on meta", lambda: (t(2, 3), t(2, 4), t(4, 3, device=meta)),
     r"same device, but got self on cpu and weight on meta"),
]


def _with_grad_modes(args: tuple, mode: str) -> tuple:
    """The arguments as plain tensors, leaves requiring grad, or dual tensors."""
    def convert(a):
        if not isinstance(a, torch.Tensor) or not (a.is_floating_point() or a.is_complex()):
            return a
        if mode == "requires_grad":
            return a.requires_grad_()
        if mode == "dual":
            return fwAD.make_dual(a, torch.randn_like(a))
        return a

    return tuple(convert(a) for a in args)


GRAD_MODES = ["plain", "requires_grad", "dual"]


@pytest.mark.parametrize("mode", GRAD_MODES)
@pytest.mark.parametrize("name,make_args,message", LINEAR_ERRORS, ids=[e[0] for e in LINEAR_ERRORS])
def test_linear_rejects(name: str, make_args, message: str, mode: str) -> None:
    with fwAD.dual_level():
        args = _with_grad_modes(make_args(), mode)
        with pytest.raises(RuntimeError, match=ATEN_FIRST + "batchrules.linear: .*" + message):
            batchrules.linear(*args)


# F.linear lets one meta operand beside CPU ones through (the result is meta),
# and lets a contiguous N-D input's 2-D bias index its flattened rows.
F_LINEAR_ACCEPTS = {"weight on meta", "input on meta", "bias of flattened rows"}


@pytest.mark.parametrize("name,make_args,message", LINEAR_ERRORS, ids=[e[0] for e in LINEAR_ERRORS])
def test_F_linear_rejects_the_same(name: str, make_args, message: str) -> None:
    if name in F_LINEAR_ACCEPTS:
        F.linear(*make_args())
    else:
        with pytest.raises(RuntimeError):
            F.linear(*make_args())


@pytest.mark.parametrize("mode", GRAD_MODES)
@pytest.mark.parametrize("name,make_args,message", LINEAR_BACKWARD_ERRORS,
                         ids=[e[0] for e in LINEAR_BACKWARD_ERRORS])
def test_linear_backward_rejects(name: str, make_args, message: str, mode: str) -> None:
    with fwAD.dual_level():
        args = _with_grad_modes(make_args(), mode)
        with pytest.raises(RuntimeError, match=ATEN_FIRST + "batchrules.linear_backward: .*" + message):
            batchrules.linear_backward(*args)


def test_errors_on_meta_match_cpu() -> None:
    """Shape errors do not depend on the device (FakeTensor / meta tracing)."""
    for _, make_args, message in LINEAR_ERRORS[:10]:
        args = tuple(a.to("meta") for a in make_args())
        with pytest.raises(RuntimeError, match=message):
            batchrules.linear(*args)
    for _, make_args, message in LINEAR_BACKWARD_ERRORS[:7]:
        args = tuple(a.to("meta") for a in make_args())
        with pytest.raises(RuntimeError, match=message):
            batchrules.linear_backward(*args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_cpu_mix_rejected() -> None:
    x, w, b = t(2, 3), t(4, 3), t(4)
    with pytest.raises(RuntimeError, match="same device, but got input on cpu and weight on cuda"):
        batchrules.linear(x, w.cuda())
    with pytest.raises(RuntimeError, match="same device, but got input on cuda:0 and bias on cpu"):
        batchrules.linear(x.cuda(), w.cuda(), b)
    # A 0-d CPU bias is a scalar, as everywhere in ATen.
    torch.testing.assert_close(batchrules.linear(x.cuda(), w.cuda(), b[0]).cpu(),
                               F.linear(x, w, b[0]))


def test_0d_cpu_bias_beside_meta_is_a_scalar() -> None:
    x, w, b = t(2, 3, device=meta), t(4, 3, device=meta), t()
    out = batchrules.linear(x, w, b)
    assert out.device == meta and out.shape == F.linear(x, w, b).shape


def test_none_operands_rejected() -> None:
    """The raw op takes None for a Tensor argument; it must not be mistaken for a shape."""
    w = t(4, 3)
    with pytest.raises(RuntimeError, match="batchrules.linear: expected input and weight to be "
                                           "tensors, but got None"):
        torch.ops.batchrules.linear(t(2, 3), None)
    with pytest.raises(RuntimeError, match="batchrules.linear: expected input and weight"):
        torch.ops.batchrules.linear(None, w)
    with pytest.raises(RuntimeError, match="batchrules.linear_backward: expected self, "
                                           "grad_output and weight to be tensors, but got None"):
        torch.ops.batchrules.linear_backward(t(2, 3), None, w, [True, True, True])


def test_output_mask_length() -> None:
    x, g, w = t(2, 3), t(2, 4), t(4, 3)
    with pytest.raises(ValueError, match="output_mask must have 3 entries, got 2"):
        batchrules.linear_backward(x, g, w, (True, False))
    with pytest.raises(RuntimeError, match="3"):
        torch.ops.batchrules.linear_backward(x, g, w, [True, False])


def test_opinfo_error_inputs_raise_here_too() -> None:
    """PyTorch's ErrorInputs for F.linear, if its OpInfo defines any."""
    errors = opinfo_error_inputs("cpu")
    if not errors:
        pytest.skip("torch's OpInfo for nn.functional.linear defines no error_inputs")
    for error in errors:
        s = error.sample_input
        with pytest.raises(error.error_type):
            batchrules.linear(s.input, *s.args, **s.kwargs)


def test_messages_name_the_op_once() -> None:
    """No message repeats the op name or leaks C++ source locations."""
    for _, make_args, _ in LINEAR_ERRORS:
        with pytest.raises(RuntimeError) as info:
            batchrules.linear(*make_args())
        text = str(info.value)
        assert text.count("batchrules.linear") == 1, text
        assert not re.search(r"\.cpp|Exception raised from", text), text
