"""What a rule provides (the classes of ``dp/layers/``), and the helpers their
``intercept`` uses.

A ``Rule`` handles some torch functions when the loss calls them directly at
clipped_grad's vmap level with a parameter among the arguments
(interceptor.py). A layer rule is a ``Use`` subclass: its ``intercept`` runs
the call on physical tensors and records one instance, a use of its
parameters, on the tape (tape.py); a use gives its per-sample gradient of a
parameter when that is materialized. The ``Clipping`` registered for the
use's ``kind`` computes, after the backward, a weight's per-sample squared
norms and clipped sum from its uses' recorded inputs and output gradients
(clipping.py). A rule without uses of its own (a composite that records other
rules' uses, or a refusal) is a plain ``Rule``.
"""
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Dict, Generic, List, Optional, Sequence, Tuple, Type, TypeVar

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge

from .._compat import add_batch_dim, batched_level, unwrap_batched
from .tape import Param, Tape

# A rule's answer when it does not handle a call: the call then takes the
# generic path (Note [Per-sample copies] in tape.py).
NOT_HANDLED = object()
# A Rule.batch_dims entry: the argument is shared by the samples, whatever its shape.
NOT_SPLIT = "not split"
# The dtypes autocast casts (float64 it leaves alone): autocast_matches.
_AUTOCAST_CASTS = {torch.float32, torch.float16, torch.bfloat16}


class Rule:
    """The torch functions a rule intercepts, and how."""

    functions: ClassVar[Tuple[Callable, ...]]

    @classmethod
    def intercept(cls, tape: Tape, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """The call's result (batched at the tape's level), or NOT_HANDLED."""
        raise NotImplementedError

    @classmethod
    def intercept_batch_first(cls, tape: Tape, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """In the engine's batched forward, the call on its plain batch-first
        tensors without the per-call vmap (Note [A rule on the plain batch] in
        batched_forward.py): its result, or NOT_HANDLED. A rule that defines it
        is looked up first."""
        return NOT_HANDLED

    @classmethod
    def batch_dims(cls, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Tuple[Any, Any]]:
        """In the engine's batched forward, where the call holds the batch
        (Note [A batched forward, one vmap per call] in batched_forward.py):
        ``(in_dims, out_dims)``, pytree prefixes of ``(args, kwargs)`` and of
        the result, an int where that is the batch's dim, None where the
        default reads it (dim 0 of the tensors that have the batch's size);
        None: the default everywhere."""
        return None


@dataclass
class Factors:
    """A weight's per-sample gradient through some uses as a sum of outer
    products, ``G_i = sum_t u_i,t (x) v_i,t`` in the weight's layout viewed as
    ``[P, Q]`` (Note [Cross terms of tied parameters] in cost.py)."""

    batch: int  # B
    rows: int  # T
    p: int
    q: int
    indexed: bool  # u_i,t = one-hot(k_i,t): ``at`` gives the indices k
    # A slice of samples' u ([b, T, P], or [b, T] indices) and v ([b, T, Q]).
    at: Callable[[slice], Tuple[Tensor, Tensor]]
    copies: int = 0  # elements per sample that ``at`` allocates

    @staticmethod
    def of_rows(us: List[Tensor], vs: List[Tensor]) -> "Factors":
        """From each use's dense rows ``[B, T_k, P]`` and ``[B, T_k, Q]``."""
        rows, p, q = sum(u.shape[1] for u in us), us[0].shape[-1], vs[0].shape[-1]
        return Factors(us[0].shape[0], rows, p, q, False,
                       lambda s: (cat_rows([u[s] for u in us]), cat_rows([v[s] for v in vs])),
                       rows * (p + q) if len(us) > 1 else 0)


def cat_rows(parts: List[Tensor]) -> Tensor:
    """Several uses' ``[b, T_k, ...]`` rows as one use's (no copy for one)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


class Use(Rule):
    """One intercepted call that used parameters through a detached copy: the
    record its rule's ``intercept`` puts on the tape.

    ``edge`` is the autograd edge of the call's physical output (a tensor that
    is not a view; see Note [Tapping an output that may later change in
    place] in tape.py); after the backward, a use whose output reached the
    loss holds in ``grad`` ``d sum_i loss_i / d out``, reshaped by
    ``set_grad`` (the others are dropped from their parameters' uses).
    """

    edge: GradientEdge
    grad: Tensor
    # The Clipping of the weights these uses apply (CLIPPINGS); the default
    # factors none: their per-sample gradients are materialized.
    kind: ClassVar[str] = "materialized"
    # The uses of one call that read back the same output gradient, this one
    # included, where their Clipping offers ``joint_norms_sq`` for them.
    grad_partners: Optional[List["Use"]] = None

    def roles(self) -> Dict[Param, str]:
        """The parameters of this use, each with its role ("weight" / "bias")."""
        raise NotImplementedError

    def set_grad(self, grad: Tensor) -> None:
        """Takes the output's gradient (in the weight's dtype) and brings the
        recorded floating-point inputs to its dtype (Note [clipped_grad under
        autocast] in transform.py)."""
        raise NotImplementedError

    def per_sample_grad(self, role: str) -> Tensor:
        """``[B, *param.shape]``: the per-sample gradient of one role's param
        through this use (the materialized path)."""
        raise NotImplementedError

    def release(self) -> None:
        """Drops the recorded tensors once every parameter of the use is summed."""
        raise NotImplementedError


U = TypeVar("U", bound=Use)


class Clipping(Generic[U]):
    """How the weights that uses of one kind apply are clipped without their
    per-sample gradients: norms and clipped sums from the uses' records.

    The methods take a weight's live uses, all of this kind and in the role
    "weight", and its fused bias: a parameter used in the role "bias" by
    exactly those calls, or None (see clipping.py). This base class factors
    no use: the weight's per-sample gradient is materialized.
    """

    # Whether ``norms_sq`` covers the fused bias too; if not, the bias' norm
    # comes from its per-sample gradient.
    norms_include_bias: ClassVar[bool] = False

    def factored(self, uses: List[U]) -> bool:
        """Whether ``norms_sq`` and ``clipped_sum`` take these uses of a weight;
        if not, its per-sample gradient is materialized."""
        return False

    def factors(self, uses: List[U]) -> Optional[Factors]:
        """These uses' part of the weight's per-sample gradient, as factors,
        for a weight also used by other kinds or calls (clipping.py); None:
        not offered (the weight's per-sample gradient is then materialized)."""
        return None

    def norms_sq(self, uses: List[U], bias: Optional[Param]) -> Tensor:
        """``[B]``: the weight's per-sample squared gradient norms (and its
        fused bias' when ``norms_include_bias``)."""
        raise NotImplementedError

    def clipped_sum(self, uses: List[U], coef: Tensor, bias: Optional[Param],
                    owned: Callable[[Tensor], bool]) -> Tuple[Tensor, Optional[Tensor]]:
        """``sum_i coef_i (gradient of sample i)`` for the weight and for
        ``bias`` (None without one). ``owned(g)``: whether the recorded output
        gradient ``g`` may be scaled in place (clipping.py)."""
        raise NotImplementedError

    def joint_norms_sq(self, uses: List[U], biases: List[Optional[Param]]) -> Tensor:
        """``[B]``: the summed squared norms of several weights, each used once,
        by these uses that share one output gradient (``grad_partners``), and
        of their fused biases (Note [Weights sharing an output gradient] in
        clipping.py)."""
        raise NotImplementedError


# Each kind's Clipping, by ``Use.kind``: what clipping.py clips a weight with.
CLIPPINGS: Dict[str, Clipping[Any]] = {Use.kind: Clipping()}
C = TypeVar("C", bound=Type[Clipping[Any]])


def register_clipping(kind: str) -> Callable[[C], C]:
    """Class decorator: an instance of the class clips the weights of the uses
    whose ``kind`` is ``kind``."""
    def add(clipping: C) -> C:
        if kind in CLIPPINGS:
            raise ValueError(f"clipped_grad: two Clippings of the kind {kind!r}")
        CLIPPINGS[kind] = clipping()
        return clipping
    return add


Intercept = Callable[[Tape, Tuple[Any, ...], Dict[str, Any]], Any]  # a Rule.intercept
BatchDims = Callable[[Tuple[Any, ...], Dict[str, Any]], Optional[Tuple[Any, Any]]]  # a Rule.batch_dims
# Each intercepted torch function's rule: what the Interceptor looks calls up in.
INTERCEPTS: Dict[Callable, Intercept] = {}
# The functions whose rule lays the batch elsewhere than dim 0 (Rule.batch_dims).
BATCH_DIMS: Dict[Callable, BatchDims] = {}
# The functions whose rule runs the engine's call on the plain batch (Rule.intercept_batch_first).
BATCH_FIRST: Dict[Callable, Intercept] = {}
R = TypeVar("R", bound=Type[Rule])


def register(rule: R) -> R:
    """Class decorator: ``rule`` intercepts its ``functions`` (its module is
    imported in layers/__init__.py)."""
    for f in rule.functions:
        if f in INTERCEPTS:
            raise ValueError(f"clipped_grad: two rules intercept {f}")
        INTERCEPTS[f] = rule.intercept
        if _overrides(rule, "batch_dims"):
            BATCH_DIMS[f] = rule.batch_dims
        if _overrides(rule, "intercept_batch_first"):
            BATCH_FIRST[f] = rule.intercept_batch_first
    return rule


def _overrides(rule: Type[Rule], name: str) -> bool:
    """Whether ``rule`` or a base other than ``Rule`` defines ``name``."""
    return any(name in vars(c) for c in rule.__mro__ if c is not Rule)


def bind(names: Sequence[str], defaults: Sequence[Any], args: Tuple[Any, ...],
         kwargs: Dict[str, Any]) -> Optional[Tuple[Any, ...]]:
    """The arguments of a call by position, ``defaults`` filling the trailing
    ones; None when the call does not fit ``names`` (the op then reports it)."""
    required = len(names) - len(defaults)
    if not kwargs and required <= len(args) <= len(names):  # positional only, the common call
        return tuple(args) + tuple(defaults[len(args) - required:])
    if len(args) > len(names) or any(k not in names for k in kwargs):
        return None
    values = list(args)
    for i in range(len(args), len(names)):
        if names[i] in kwargs:
            values.append(kwargs[names[i]])
        elif i >= required:
            values.append(defaults[i - required])
        else:
            return None
    if any(names[i] in kwargs for i in range(len(args))):
        return None
    return tuple(values)


def physical(tape: Tape, x: Any) -> Optional[Tensor]:
    """``x`` as a physical batch-first tensor ``[B, *per-sample shape]``: its
    storage if it is batched at clipped_grad's level, an expansion (no copy)
    if it is a plain tensor shared by all samples; None otherwise."""
    if not isinstance(x, Tensor) or tape.param(x) is not None:
        return None
    level = batched_level(x)
    if level == tape.level:
        value, bdim = unwrap_batched(x, level)
        return value if bdim == 0 else value.movedim(bdim, 0)
    if level == -1:
        return x.expand(tape.batch_size, *x.shape)
    return None


def batched(tape: Tape, value: Tensor) -> Tensor:
    """A batch-first physical result, handed back to the loss as per-sample."""
    return add_batch_dim(value, 0, tape.level)


def autocast_matches(x: Tensor, w: Tensor) -> bool:
    """Whether a matmul-like op (linear, addmm, convolution: on autocast's
    lower-precision list on CPU and CUDA) of ``x`` and the parameter ``w`` runs
    as recorded: the same dtype, or two of the dtypes autocast casts, under
    autocast (Note [clipped_grad under autocast] in transform.py)."""
    if x.dtype == w.dtype:
        return True
    return ({x.dtype, w.dtype} <= _AUTOCAST_CASTS
            and torch.is_autocast_enabled(x.device.type))


def autocast_dtype(x: Tensor) -> Optional[torch.dtype]:
    """The dtype autocast casts ``x`` to for an op on its lower-precision list,
    None outside autocast (or for a dtype it leaves alone)."""
    device = x.device.type
    if x.dtype in _AUTOCAST_CASTS and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return None
