"""Sample inputs for batchrules.linear / linear_backward tests.

PyTorch's own OpInfo samples for ``nn.functional.linear`` (and their
non-contiguous twins), plus the shapes and layouts they miss: 1-D weights,
every bias shape F.linear broadcasts, empty tensors, many leading dims,
transposed / expanded / strided / conjugated operands. Each sample has a
``kind`` naming what it exercises, so slow checks can subsample per kind.
"""
import functools
from dataclasses import dataclass
from typing import Callable, Dict, Hashable, Iterator, List, Optional, Tuple

import torch
from torch import Tensor
from torch.testing import make_tensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
COMPLEX_DTYPES = (torch.complex64, torch.complex128)
ALL_DTYPES = FLOAT_DTYPES + COMPLEX_DTYPES


@dataclass
class LinearSample:
    """One ``(input, weight, bias)`` call; ``kind`` says what it exercises."""

    kind: str
    input: Tensor
    weight: Tensor
    bias: Optional[Tensor] = None

    @property
    def args(self) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        return (self.input, self.weight, self.bias)

    def __repr__(self) -> str:
        def describe(t: Optional[Tensor]) -> str:
            return "None" if t is None else f"{list(t.shape)}/{t.stride()}"

        return (f"{self.kind}(input={describe(self.input)}, weight={describe(self.weight)}, "
                f"bias={describe(self.bias)}, {self.input.dtype})")


@functools.lru_cache(maxsize=None)
def _linear_opinfo():
    from torch.testing._internal.common_methods_invocations import op_db

    (opinfo,) = [op for op in op_db if op.name == "nn.functional.linear"]
    return opinfo


def opinfo_error_inputs(device: str) -> List:
    """PyTorch's ErrorInputs for F.linear (torch 2.13 defines none; kept in case it does)."""
    opinfo = _linear_opinfo()
    if opinfo.error_inputs_func is None:
        return []
    return list(opinfo.error_inputs(device))


def _opinfo_samples(device: str, dtype: torch.dtype) -> Iterator[LinearSample]:
    for sample in _linear_opinfo().sample_inputs(device, dtype, requires_grad=False):
        for kind, s in (("opinfo", sample), ("opinfo_noncontiguous", sample.noncontiguous())):
            bias = s.args[1] if len(s.args) > 1 else s.kwargs.get("bias")
            yield LinearSample(kind, s.input, s.args[0], bias)


def _extra_samples(device: str, dtype: torch.dtype) -> Iterator[LinearSample]:
    make = functools.partial(make_tensor, device=device, dtype=dtype, low=-2, high=2)
    S = LinearSample
    # 1-D weight: the output has no out_features dim.
    yield S("weight_1d", make(5, 3), make(3))
    yield S("weight_1d", make(3), make(3))
    yield S("weight_1d", make(3), make(3), make(()))
    yield S("weight_1d", make(2, 4, 3), make(3), make(()))
    yield S("weight_1d", make(2, 4, 3), make(3), make(2, 4))
    # Bias shapes F.linear broadcasts besides (out_features,).
    yield S("bias_broadcast", make(4, 3), make(5, 3), make(()))
    yield S("bias_broadcast", make(4, 3), make(5, 3), make(1))
    yield S("bias_broadcast", make(3), make(5, 3), make(()))
    yield S("bias_broadcast", make(3), make(5, 3), make(1, 5))
    yield S("bias_broadcast", make(4, 3), make(5, 3), make(4, 5))
    yield S("bias_broadcast", make(4, 3), make(5, 3), make(4, 1))
    yield S("bias_broadcast", make(2, 4, 3), make(5, 3), make(2, 1, 5))
    # Bias shapes that broadcast but that F.linear rejects for some layouts
    # (its addmm fast path for contiguous input needs a 2-D weight and a bias
    # of <= 2 dims; its in-place bias add cannot enlarge the output).
    yield S("bias_layout_quirk", make(3), make(3), make(1))
    yield S("bias_layout_quirk", make(2, 4, 3), make(3), make(1))
    yield S("bias_layout_quirk", make(2, 4, 3), make(3), make(4))
    yield S("bias_layout_quirk", make(2, 4, 3), make(5, 3), make(1, 1, 5))
    yield S("bias_layout_quirk", make(3), make(1, 3), make(1, 1))
    yield S("bias_layout_quirk", make(3), make(5, 3), make(1, 10)[:, ::2])
    # Many leading dims.
    yield S("leading_dims", make(2, 1, 2, 1, 2, 3), make(4, 3), make(4))
    yield S("leading_dims", make(2, 1, 2, 1, 2, 3), make(4, 3))
    # Empty tensors: no rows, no out_features, no in_features.
    yield S("empty", make(2, 0, 3), make(4, 3), make(4))
    yield S("empty", make(0, 3), make(3))
    yield S("empty", make(4, 3), make(0, 3), make(0))
    yield S("empty", make(4, 0), make(5, 0), make(5))
    yield S("empty", make(0), make(5, 0))
    yield S("single_feature", make(4, 1), make(5, 1), make(5))
    # Layouts: transposed, expanded (stride 0), strided, permuted operands.
    yield S("input_transposed", make(3, 4).t(), make(5, 3), make(5))
    yield S("input_expanded", make(1, 3).expand(4, 3), make(5, 3), make(5))
    yield S("input_expanded", make(3).expand(2, 4, 3), make(5, 3))
    yield S("input_strided", make(2, 4, 6)[..., ::2], make(5, 3), make(5))
    yield S("input_permuted", make(3, 2, 4).permute(1, 2, 0), make(5, 3), make(5))
    yield S("weight_transposed", make(2, 3), make(3, 5).t(), make(5))
    yield S("weight_expanded", make(2, 3), make(1, 3).expand(5, 3), make(5))
    yield S("weight_strided", make(2, 3), make(5, 6)[:, 1::2])
    yield S("bias_strided", make(2, 3), make(5, 3), make(10)[::2])
    yield S("bias_expanded", make(2, 3), make(5, 3), make(1).expand(5))
    if dtype.is_complex:
        # Conjugate views: the conj bit must be honoured, not dropped.
        yield S("conj_view", make(2, 3).conj(), make(5, 3).conj(), make(5).conj())


def linear_samples(device: str, dtype: torch.dtype, requires_grad: bool = False,
                   kinds: Optional[Callable[[str], bool]] = None) -> List[LinearSample]:
    """All samples for ``device`` / ``dtype``; operands are leaves requiring grad
    when ``requires_grad`` (views included: they are created before)."""
    samples = []
    for s in [*_opinfo_samples(device, dtype), *_extra_samples(device, dtype)]:
        if kinds is not None and not kinds(s.kind):
            continue
        if requires_grad:
            s = LinearSample(s.kind, *(None if t is None else t.detach().requires_grad_()
                                       for t in s.args))
        samples.append(s)
    return samples


def first_of_each_kind(samples: List[LinearSample], per_kind: int = 1,
                       kind: Callable[[LinearSample], Hashable] = lambda s: s.kind
                       ) -> List[LinearSample]:
    """A deterministic subsample keeping the first ``per_kind`` samples of
    every kind (``kind(sample)``: the sample's kind unless given)."""
    seen: Dict[Hashable, int] = {}
    kept = []
    for s in samples:
        k = kind(s)
        if seen.get(k, 0) < per_kind:
            seen[k] = seen.get(k, 0) + 1
            kept.append(s)
    return kept


def without_overlap(t: Optional[Tensor]) -> Optional[Tensor]:
    """``t``, or a dense leaf copy if it is expanded (gradcheck rejects stride-0 inputs)."""
    if t is None or 0 not in t.stride() or t.numel() <= 1:
        return t
    return t.detach().clone(memory_format=torch.contiguous_format).requires_grad_(t.requires_grad)


def random_grad_output(sample: LinearSample) -> Tensor:
    """A random grad_output of the bias-free output shape, as linear_backward takes it."""
    x, w, _ = sample.args
    with torch.no_grad():
        out = torch.nn.functional.linear(x.detach(), w.detach())
    return make_tensor(out.shape, device=out.device, dtype=out.dtype, low=-2, high=2)


def linear_reference(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """F.linear's semantics for every bias that broadcasts, whatever the layout:
    ``F.linear(input, weight)`` plus the bias, whose extra leading size-1 dim
    (allowed for a 1-D input, which F.linear computes as a 1-row matrix) is dropped."""
    out = torch.nn.functional.linear(input, weight)
    if bias is None:
        return out
    if bias.dim() > out.dim():
        bias = bias.reshape(bias.shape[bias.dim() - out.dim():])
    return out + bias
