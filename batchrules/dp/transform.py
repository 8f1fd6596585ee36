"""``batchrules.clipped_grad``: DP-SGD's clipped gradient sum without per-sample gradients.

Note [Forward under vmap, backward outside it]
The loss runs once under ``vmap(loss, in_dims)`` with the differentiated
arguments unbatched: vmap passes them through unwrapped, so inside the
vmapped function they are the very tensors clipped_grad passed in (leaves of
a tensor subclass), and every call that takes one reaches the Interceptor
(Note [Intercepting only the calls that take a parameter]). Rules (layers/)
run linears, convolutions, embeddings and self-attention on the physical
(batch-first) tensors with detached weights and record each call's input
and an autograd edge of its output (tape.py); other calls get per-sample
copies of the parameters they take. The backward is ONE
``torch.autograd.grad`` of ``sum_i loss_i`` outside vmap, asked for the
recorded outputs' gradients and the per-sample copies' gradients: samples are
independent under vmap, so the gradient reaching sample i's rows of an
output is exactly ``d loss_i / d out_i``, and no weight gradient (summed or
per-sample) is ever formed by autograd. The parameters themselves are leaves
that require grad and are asked for too: every intercepted use went through
a detached copy, so a gradient reaching one means a use escaped interception
(e.g. inside a nested torch.func transform), reported instead of a wrong norm.
Norms and clipped sums then come from (input, output gradient) pairs
(clipping.py). That is book-keeping (Bu et al., ICML 2023): one forward and
one backward; Opacus' ghost clipping needs a second backward.
"""
import contextlib
import functools
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge
from torch.func import vmap
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map, tree_unflatten

from .. import routing
from .._compat import batched_level, current_transform_level, unwrap_batched, vmap_over_tensors
from .arguments import ArgNums, check_argnums, check_max_norm, dims_per_argument, is_empty_batch, positions_of
from .clipping import clip
from .compiled_step import StepSpec, traced_clipped_grad
from .gc_pause import paused_gc
from .interceptor import Interceptor, intercepted_leaf
from .layers import INTERCEPTS
from .tape import Param, Tape


def clipped_grad(loss: Callable[..., Any], max_norm: float, *, in_dims: Any = None,
                 argnums: ArgNums = 0, has_aux: bool = False,
                 randomness: str = "error") -> Callable[..., Any]:
    """DP-SGD's per-sample clipping, summed, without per-sample gradients.

    ``clipped_grad(loss, max_norm)(*args)`` returns ``(clipped_sum, norms)``
    equal to, with ``per = vmap(grad(loss, argnums), in_dims)(*args)``::

        norms[i]    = L2 norm of sample i's gradient over all differentiated tensors
        clipped_sum = sum_i min(1, max_norm / (norms[i] + 1e-6)) * per[i]

    (eps = ``batchrules.dp.EPS`` = 1e-6, as in Opacus), but computed from each
    layer's input and output gradient with one forward and one backward: the
    per-sample gradients of linear, convolution (1d/2d), embedding and
    self-attention weights are never formed whole; biases, LayerNorm's affine
    parameters and tensors used outside those ops get per-sample gradients of
    their own size.

    Args:
        loss: ``loss(*args) -> scalar tensor`` for ONE sample (or
            ``(scalar, aux)`` with ``has_aux``), as for ``vmap(grad(loss))``.
        max_norm: the clipping bound C, a finite number > 0.
        in_dims: as for ``vmap``: how each argument is batched. The
            differentiated arguments must be unbatched (``None``). Omitted:
            ``None`` for the differentiated arguments and ``0`` for all others
            (``(None, 0, 0)`` for ``(params, x, y)``).
        argnums: which argument(s) to differentiate, as for ``grad``. Each is
            any pytree of floating-point tensors (e.g. ``{k: v.detach() for
            k, v in model.named_parameters()}`` for ``functional_call``);
            a frozen ``nn.Parameter`` (``requires_grad=False``) is refused:
            leave it out of the differentiated argument.
        has_aux: the loss returns ``(loss, aux)``; the result is then
            ``((clipped_sum, norms), aux)`` with aux batched as vmap returns it.
        randomness: as for ``vmap`` (``"different"`` for dropout).

    Returns:
        A function returning ``(clipped_sum, norms)``: ``clipped_sum`` has the
        structure of the differentiated argument (a tuple of them for a tuple
        ``argnums``), ``norms`` is ``[B]``. An empty batch (B = 0) gives zero
        sums without running the loss, unless ``has_aux`` (Note [An empty
        batch]). Under ``torch.autocast`` the forward and backward run in the
        low precision as usual, while norms, clipping coefficients and clipped
        sums are formed in the parameters' dtype (float32 for float32
        parameters; Note [clipped_grad under autocast]).

    Raises at the call (ValueError / TypeError / RuntimeError, naming the
    problem): a loss that is not a scalar per sample, batch sizes that
    disagree, a batched differentiated argument, a leaf that is not a
    floating-point tensor, and a parameter reaching the loss through a call
    the interception cannot see. ``max_norm`` is checked here.
    """
    check_max_norm(max_norm)
    check_argnums(argnums)
    if torch.compiler.is_compiling():  # the spec must exist before (Note [clipped_grad under torch.compile])
        raise RuntimeError("clipped_grad(loss, max_norm, ...) cannot be created inside a compiled "
                           "function: create it once outside, and call what it returns inside")

    spec = StepSpec(loss, float(max_norm), in_dims, argnums, has_aux, randomness)

    @functools.wraps(loss)
    def clipped(*args: Any) -> Any:
        if torch.compiler.is_compiling():  # Note [clipped_grad under torch.compile]
            return traced_clipped_grad(spec, args)
        return _clipped_grad(spec, args)

    return clipped


@paused_gc()  # Note [No cyclic collection during a step]
def _clipped_grad(spec: StepSpec, args: Tuple[Any, ...]) -> Any:
    return clipped_step(spec, args)


# Note [An empty batch]
# Poisson sampling gives empty batches, which eager PyTorch runs, but vmap over
# zero samples does not always: functorch reshapes a BatchedTensor's physical
# tensor with the caller's -1 (``x.reshape(-1, n)`` of a [0, ...] tensor is
# ambiguous) and some of its rules build invalid calls (a batched conv3d's
# groups of 0). With nothing to clip the result is known without the loss:
# zero sums and norms of shape [0], as clip() gives them, so an empty batch
# skips the forward. With ``has_aux`` the loss still runs: the aux's structure
# and shapes come from it.
def clipped_step(spec: StepSpec, args: Tuple[Any, ...], traced: bool = False) -> Any:
    """One step: the forward under vmap, the one backward, the clipping;
    ``traced``: under make_fx/AOTAutograd (Note [Intercepting while traced])."""
    loss, max_norm, in_dims, argnums, has_aux, randomness = \
        spec.loss, spec.max_norm, spec.in_dims, spec.argnums, spec.has_aux, spec.randomness
    if current_transform_level() is not None:
        raise RuntimeError("clipped_grad cannot run inside a torch.func transform (vmap, grad, "
                           "...): it runs its own vmap and a plain autograd backward")
    positions = positions_of(argnums, len(args))
    dims = dims_per_argument(in_dims, positions, len(args))
    params, specs = _params(args, positions, traced)
    if not has_aux and is_empty_batch(args, dims):  # Note [An empty batch]
        zeros, no_norms = clip(params, 0, max_norm)
        results = tuple(_trees(zeros, specs))
        return results if isinstance(argnums, tuple) else results[0], no_norms
    differentiated = dict(zip(positions, _trees([p.leaf for p in params], specs)))
    # The project's routed ops (attention, losses, ...) take their batching
    # rules in the forward whatever the user's routing; restored on exit.
    with torch.enable_grad(), routing.enabled():
        losses, aux, tape = _forward(loss, has_aux, randomness, args, dims, params, differentiated, traced)
        _backward(losses, tape, params)
    with torch.no_grad(), _autocast_off(params):  # Note [clipped_grad under autocast]
        sums, norms = clip(params, tape.batch_size, max_norm, in_place=not traced)
    # A Param and its uses refer to each other: cut that cycle, so that the
    # leaves (views of the caller's tensors, e.g. FSDP's unsharded
    # parameters) go with this call, not at some later garbage collection.
    for p in params:
        p.uses.clear()
    results = tuple(_trees(sums, specs))
    result = (results if isinstance(argnums, tuple) else results[0], norms)
    return (result, tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, aux)) \
        if has_aux else result


def _forward(loss: Callable[..., Any], has_aux: bool, randomness: str, args: Tuple[Any, ...],
             dims: Tuple[Any, ...], params: List[Param],
             differentiated: Dict[int, Any], traced: bool = False) -> Tuple[Tensor, Any, Tape]:
    """Every sample's loss, under vmap and the Interceptor, its aux, and the
    tape of the uses it recorded; ``differentiated``: the arguments by
    position, of ``params``' leaves."""
    # Only the other arguments go through vmap (the differentiated ones are
    # unbatched: vmap would pass them through unchanged, after flattening them).
    others = [i for i in range(len(args)) if i not in differentiated]
    tapes: List[Tape] = []

    def per_sample(*batched_args: Any) -> Any:
        level = current_transform_level()
        assert level is not None  # under vmap
        tape = Tape(params, _batch_size(batched_args, level), level)
        tapes.append(tape)
        one = list(batched_args)
        for pos in sorted(differentiated):
            one.insert(pos, differentiated[pos])
        with Interceptor(tape, INTERCEPTS, traced):
            out = loss(*one)
        _check_loss(out, has_aux)
        return out

    vmapped, vmapped_dims = [args[i] for i in others], [dims[i] for i in others]
    if not has_aux and all(isinstance(a, Tensor) and (d is None or isinstance(d, int))
                           for a, d in zip(vmapped, vmapped_dims)):
        # See Note [clipped_grad's vmap over plain tensors] in _compat.py.
        out = vmap_over_tensors(per_sample, vmapped, vmapped_dims, randomness)
    else:
        out = vmap(per_sample, in_dims=tuple(vmapped_dims), randomness=randomness)(*vmapped)
    losses, aux = out if has_aux else (out, None)
    return losses, aux, tapes[-1]


def _backward(losses: Tensor, tape: Tape, params: List[Param]) -> None:
    """The one backward (Note [Forward under vmap, backward outside it]):
    output gradients onto the recorded uses, per-sample copies' gradients
    onto their params."""
    copies = [p for p in params if p.copy is not None]
    inputs: List[Union[GradientEdge, Tensor]] = [u.edge for u in tape.uses]
    inputs += [p.copy for p in params if p.copy is not None] + [p.leaf for p in params]
    grads: Tuple[Optional[Tensor], ...] = (None,) * len(inputs)
    if losses.requires_grad and inputs:
        # The leaves are interceptor.Differentiated: no __torch_function__ round trip.
        with torch._C.DisableTorchFunctionSubclass():
            # torch's stub takes tensors or edges; autograd.grad takes both together
            grads = torch.autograd.grad(losses.sum(), inputs, allow_unused=True)  # type: ignore[arg-type]
    leaf_grads = grads[len(tape.uses) + len(copies):]
    escaped = [p.name for p, g in zip(params, leaf_grads) if g is not None]
    if escaped:
        raise RuntimeError(
            f"clipped_grad: {', '.join(escaped)} reached the loss through a call the interception "
            "did not see (a nested torch.func transform, a torch.autograd.Function, a tensor "
            "subclass, or a hook), so its per-sample norm would be wrong. Use it directly in "
            "the loss (as functional_call does), outside nested transforms")
    tape.check_inputs_unchanged()
    tape.take_grads(grads)
    for p, g in zip(copies, grads[len(tape.uses):]):
        p.copy_grad = g


def _params(args: Tuple[Any, ...], positions: Tuple[int, ...],
            traced: bool = False) -> Tuple[List[Param], List[Any]]:
    """The differentiated tensors as Params, and each position's pytree spec."""
    params: List[Param] = []
    specs = []
    for pos in positions:
        leaves, spec = tree_flatten(args[pos])
        namer = _Namer(args[pos], pos)
        for k, leaf in enumerate(leaves):
            if not isinstance(leaf, Tensor):
                raise TypeError(f"clipped_grad: {namer(k)} is a {type(leaf).__name__}; "
                                "differentiated arguments must hold only floating-point tensors")
            if not leaf.is_floating_point():
                raise TypeError(f"clipped_grad: {namer(k)} has dtype {leaf.dtype}; only "
                                "floating-point tensors can be differentiated")
            if isinstance(leaf, nn.Parameter) and not leaf.requires_grad:
                raise ValueError(f"clipped_grad: {namer(k)} is an nn.Parameter with "
                                 "requires_grad=False (frozen); leave it out of the differentiated "
                                 "argument (pass it in another, unbatched argument) or unfreeze it")
        with torch._C.DisableTorchFunctionSubclass():  # a plain tensor of any subclass
            values = [leaf.detach() for leaf in leaves]
        # See Note [Forward under vmap, backward outside it].
        params += [Param(len(params) + k, functools.partial(namer, k), intercepted_leaf(value, traced), value)
                   for k, value in enumerate(values)]
        specs.append(spec)
    return params, specs


class _Namer:
    """Names a differentiated leaf by its key path (``argument 0['0.weight']``),
    computed only when a message needs it."""

    def __init__(self, tree: Any, position: int) -> None:
        self.tree, self.position = tree, position

    def __call__(self, k: int) -> str:
        path = tree_flatten_with_path(self.tree)[0][k][0]
        return f"argument {self.position}{keystr(path)}"


def _trees(leaves: List[Any], specs: List[Any]) -> List[Any]:
    """``leaves``, in order, as one pytree per spec."""
    it = iter(leaves)
    return [tree_unflatten([next(it) for _ in range(spec.num_leaves)], spec) for spec in specs]


def _batch_size(args: Tuple[Any, ...], level: int) -> int:
    for arg in args:  # plain tensor arguments first: no pytree walk
        if isinstance(arg, Tensor) and batched_level(arg) == level:
            value, bdim = unwrap_batched(arg, level)
            return value.shape[bdim]
    for leaf in tree_flatten(args)[0]:
        if isinstance(leaf, Tensor) and batched_level(leaf) == level:
            value, bdim = unwrap_batched(leaf, level)
            return value.shape[bdim]
    raise AssertionError("vmap passed no batched argument")


def _check_loss(out: Any, has_aux: bool) -> None:
    if has_aux:
        if not isinstance(out, tuple) or len(out) != 2:
            raise ValueError("clipped_grad(has_aux=True): the loss must return a (loss, aux) "
                             f"pair, got {type(out).__name__}")
        out = out[0]
    if not isinstance(out, Tensor):
        raise TypeError(f"clipped_grad: the loss must return a tensor, got {type(out).__name__}")
    if out.dim() != 0 or not out.is_floating_point():
        raise ValueError(f"clipped_grad: the loss must return a floating-point scalar per sample; "
                         f"got shape {tuple(out.shape)} and dtype {out.dtype} for one sample")


# Note [clipped_grad under autocast]
# Under torch.autocast a recorded output (a linear's, say) comes out in the low
# precision, and so does its gradient, and a recorded input may be in either.
# The rules of autocast's lower-precision ops (linear, addmm, convolution) take
# a low-precision input with a float32 parameter, as autocast does
# (rule.autocast_matches); the generic path would copy the weight per sample.
# The gradients are cast to their parameter's dtype (and each use's
# ``set_grad`` brings its recorded inputs to that dtype too), and norms,
# clipping coefficients and clipped sums are then formed with autocast off: in
# float32 for float32 parameters, as the materialized reference (vmap(grad) +
# clip + sum) forms them from float32 per-sample gradients (autograd returns
# those in the parameter's dtype).
def _autocast_off(params: List[Param]) -> Any:
    device = params[0].value.device.type if params else "cpu"
    # Entering torch.autocast is not free inside a step (its caches cold): only when it is on
    if not torch.amp.is_autocast_available(device) or not torch.is_autocast_enabled(device):
        return contextlib.nullcontext()
    return torch.autocast(device, enabled=False)
