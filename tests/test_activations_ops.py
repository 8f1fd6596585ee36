"""batchrules.silu / mish and their backward ops in eager mode: values against
ATen's kernels and F.silu / F.mish autograd, torch.library.opcheck, and bad
input (a clear RuntimeError naming the op, dtypes and shapes)."""
import pytest
import torch
import torch.autograd.forward_ad as fwAD
from activation_samples import ACTS, BACKWARD_SHAPES, SHAPES, Act, sample
from conftest import available_devices

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor",
                 "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_forward_is_atens_kernel(act: Act, dtype: torch.dtype, layout: str) -> None:
    """Bit for bit what F.silu / F.mish compute (the same ATen kernel)."""
    for shape in SHAPES:
        x = sample(shape, dtype, layout=layout)
        out = act.op(x)
        torch.testing.assert_close(out, act.stock(x), rtol=0, atol=0)
        assert out.stride() == act.stock(x).stride()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_backward_is_atens_kernel(act: Act, dtype: torch.dtype) -> None:
    for g_shape, x_shape in BACKWARD_SHAPES:
        g, x = sample(g_shape, dtype, seed=1), sample(x_shape, dtype)
        torch.testing.assert_close(act.backward(g, x), act.stock_backward(g, x), rtol=0, atol=0)


@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_backward_is_the_derivative(act: Act) -> None:
    """grad_output * f'(self) against autograd through the stock activation (float64)."""
    for shape in SHAPES:
        x, g = sample(shape, requires_grad=True), sample(shape, seed=1)
        (want,) = torch.autograd.grad(act.stock(x), x, g)
        torch.testing.assert_close(act.backward(g, x.detach()), want)


def test_complex_silu_runs_forward() -> None:
    z = torch.randn(3, 4, dtype=torch.complex128)
    g = torch.randn(3, 4, dtype=torch.complex128)
    torch.testing.assert_close(torch.ops.batchrules.silu(z), torch.nn.functional.silu(z))
    torch.testing.assert_close(torch.ops.batchrules.silu_backward(g, z),
                               torch.ops.aten.silu_backward(g, z))


# ---------------------------------------------------------------- opcheck

def opcheck_samples(act: Act, device: str, dtype: torch.dtype, requires_grad: bool):
    ops = torch.ops.batchrules
    op, backward = getattr(ops, act.name).default, getattr(ops, f"{act.name}_backward").default
    for shape in SHAPES:
        yield op, (sample(shape, dtype, requires_grad).to(device),)
    for g_shape, x_shape in BACKWARD_SHAPES:
        yield backward, (sample(g_shape, dtype, requires_grad, seed=1).to(device),
                         sample(x_shape, dtype, requires_grad).to(device))


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "requires_grad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("device", available_devices() + ["meta"])
@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_opcheck(act: Act, device: str, dtype: torch.dtype, requires_grad: bool) -> None:
    """Schema, autograd registration, FakeTensor and AOTAutograd (dynamic shapes)."""
    for op, args in opcheck_samples(act, device, dtype, requires_grad):
        results = torch.library.opcheck(op, args, test_utils=OPCHECK_UTILS,
                                        raise_exception=False)
        failed = {k: v for k, v in results.items() if v != "SUCCESS"}
        assert not failed, f"{op} on {[tuple(a.shape) for a in args]}: {failed}"


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("dtype,dtype_name", [(torch.int64, "Long"), (torch.int32, "Int"),
                                              (torch.bool, "Bool")])
@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_non_floating_input(act: Act, dtype: torch.dtype, dtype_name: str) -> None:
    x = torch.ones(2, 3, dtype=dtype)
    kinds = "floating-point or complex" if act.complex_forward else "floating-point"
    with pytest.raises(RuntimeError, match=rf"batchrules.{act.name}: expected self to be a "
                                           rf"{kinds} tensor, but got {dtype_name}"):
        act.op(x)
    with pytest.raises(RuntimeError, match=rf"batchrules.{act.name}_backward: expected self to "
                                           rf"be a {kinds} tensor, but got {dtype_name}"):
        act.backward(x, x)


def test_non_floating_input_raises_as_eager(routing_on) -> None:
    """aten's exception type and message first, also routed under vmap."""
    x = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(NotImplementedError, match="^\"silu_cpu\" not implemented for 'Long'"):
        torch.nn.functional.silu(x)
    with pytest.raises(NotImplementedError, match="^\"silu_cpu\" not implemented for 'Long'; "):
        torch.func.vmap(torch.nn.functional.silu)(x)


def test_complex_mish_is_rejected() -> None:
    z = torch.randn(3, dtype=torch.complex64)
    with pytest.raises(RuntimeError, match=r"batchrules.mish: expected self to be a "
                                           r"floating-point tensor, but got ComplexFloat"):
        torch.ops.batchrules.mish(z)


def test_complex_silu_autograd_is_rejected() -> None:
    """As for aten::silu (mish rejects complex values before autograd)."""
    z = torch.randn(3, dtype=torch.complex128, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"batchrules.silu does not support automatic "
                                           r"differentiation for complex inputs"):
        torch.ops.batchrules.silu(z)
    with fwAD.dual_level():
        dual = fwAD.make_dual(z.detach(), torch.ones_like(z))
        with pytest.raises(RuntimeError, match="does not support automatic differentiation"):
            torch.ops.batchrules.silu(dual)


@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_backward_dtype_mismatch(act: Act) -> None:
    g, x = torch.randn(3), torch.randn(3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=rf"batchrules.{act.name}_backward: expected "
                                           r"grad_output and self to have the same dtype, but got "
                                           r"grad_output Float and self Double"):
        act.backward(g, x)


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_backward_shapes_not_broadcastable(act: Act, device: str) -> None:
    g, x = torch.randn(2, 3, device=device), torch.randn(4, 3, device=device)
    with pytest.raises(RuntimeError, match=rf"batchrules.{act.name}_backward: grad_output of "
                                           r"shape \[2, 3\] and self of shape \[4, 3\] cannot be "
                                           r"broadcast together"):
        act.backward(g, x)


@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_backward_device_mismatch(act: Act) -> None:
    g, x = torch.randn(3, device="meta"), torch.randn(3)
    with pytest.raises(RuntimeError, match=r"expected grad_output and self to be on the same "
                                           r"device, but got grad_output on meta and self on cpu"):
        act.backward(g, x)


@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_non_tensor_arguments(act: Act) -> None:
    with pytest.raises((TypeError, RuntimeError)):
        act.op(None)  # type: ignore[arg-type]
    with pytest.raises((TypeError, RuntimeError)):
        act.backward(torch.randn(3), [1.0, 2.0, 3.0])  # type: ignore[arg-type]
