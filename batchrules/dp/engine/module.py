"""``PrivateModule``: the user's model, whose backward yields clipped sums.

The forward runs the model on its physical batch with its parameters as
intercepted leaves (Note [A batched forward, one vmap per call]); the user's
``loss.backward()`` then clips each sample's gradient and adds the clipped
sums up (Note [The clipping runs at the end of the user's backward]); the
``DPOptimizer`` (optimizer.py) takes them at its step. The rules and the
clipping are clipped_grad's.
"""
import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from ..clipping import clip
from ..interceptor import Interceptor, intercepted_leaf
from ..layers import INTERCEPTS
from ..tape import Tape
from .compiled_forward import ForwardSpec, make_sinks, traced_forward
from .fsdp import fsdp_modules, hooks_set_aside, plain_forwards, reshard, unshard
from .kept_leaves import KeptLeaves
from .parameter_slots import Slots, parameter_slots, swapped
from .recording import Recording
from .validation import FirstStep

LOSS_REDUCTIONS = ("mean", "sum")


class PrivateModule(nn.Module):
    """Wraps ``module`` for DP-SGD in the user's loop (Opacus' GradSampleModule's place).

    Args:
        module: the model. Sample i of a batch is row i of dim 0 of every
            input (batch-first); it must not mix samples (a BatchNorm in
            training mode is refused here and in the forward; anything else
            that mixes them is caught by the first-step validation).
        loss_reduction: ``"mean"`` if the loss is the mean of the per-sample
            losses over the batch (as ``F.cross_entropy``'s default), ``"sum"``
            if their sum: the per-sample gradients are then the per-sample
            losses', as Opacus defines them.
        validate: compare, at the first step, the per-sample gradient norms
            of the batched forward with samples run one at a time
            (validation.py); False skips it.

    Attributes and methods the model has are reachable through the wrapper;
    ``state_dict`` and ``load_state_dict`` are the model's own.
    """

    def __init__(self, module: nn.Module, *, loss_reduction: str = "mean",
                 validate: bool = True) -> None:
        super().__init__()
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"batchrules.dp: loss_reduction must be 'mean' or 'sum', got "
                             f"{loss_reduction!r}")
        self._batch_norms = batch_norms(module)  # checked at each forward: .train() may change
        refuse_batch_norm(self._batch_norms)
        self._module = module
        self.loss_reduction = loss_reduction
        self._max_grad_norm: Optional[float] = None
        self._spec: Optional[ForwardSpec] = None  # See Note [The engine under torch.compile].
        self._sinks: List[Tensor] = []
        self._counter: Optional[Tensor] = None
        self._sums: Dict[nn.Parameter, Tensor] = {}
        self._leaves = KeptLeaves()  # Note [Leaves kept across forwards] in kept_leaves.py
        self._backwards = 0
        self.per_sample_norms: Optional[Tensor] = None  # the last backward's, [B]
        self.first_step: Optional[FirstStep] = FirstStep() if validate else None
        # See Note [The engine on an FSDP2 model] in fsdp.py.
        self.fsdp_modules = fsdp_modules(module)
        self._unsharded = False

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_module":
                raise
            return getattr(self._module, name)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._module.load_state_dict(*args, **kwargs)

    @property
    def max_grad_norm(self) -> Optional[float]:
        """The clipping bound, set by the DPOptimizer."""
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float) -> None:
        self._max_grad_norm = value
        self._make_sinks()

    def _make_sinks(self) -> None:
        """The compiled forward's spec and sinks, for the parameters as they
        are (Note [The engine under torch.compile] in compiled_forward.py)."""
        if self._max_grad_norm is None:
            return
        named = self.trainable_parameters()
        self._spec = ForwardSpec(self._module, tuple(n for n, _ in named), self._max_grad_norm,
                                 self.loss_reduction)
        self._sinks, self._counter = make_sinks([p for _, p in named])

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        out = super()._apply(fn, *args, **kwargs)
        self._make_sinks()  # on the parameters' new device and dtype
        self._leaves = KeptLeaves()  # no view of the parameters' previous data kept
        return out

    def trainable_parameters(self) -> List[Tuple[str, nn.Parameter]]:
        """The parameters that require grad, by name (a tied one once)."""
        return parameter_slots(self._module).trainable()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() and not self.fsdp_modules:
            return self._traced_forward(args, kwargs)
        slots = parameter_slots(self._module) if torch.is_grad_enabled() else None
        named = slots.trainable() if slots is not None else []
        if slots is None or not named:
            return self._module(*args, **kwargs)
        self._check_optimizer()
        refuse_batch_norm(self._batch_norms)
        batch = batch_size(args, kwargs)
        owners = [p for _, p in named]  # FSDP's sharded ones: the optimizer's
        if self.fsdp_modules:
            if not self._unsharded:
                unshard(self.fsdp_modules)
                self._unsharded = True
            slots = parameter_slots(self._module)  # the full parameters the forward runs with
            named = slots.trainable()
        with hooks_set_aside(self.fsdp_modules):
            if batch == 0:  # nothing to clip; counted as a backward, as Opacus counts it
                self._backwards += 1
                # fresh leaves, without the kept ones' hooks: their gradients are dropped
                with swapped(slots, [(p, intercepted_leaf(p.detach())) for _, p in named]):
                    return self._module(*args, **kwargs)
            out = recorded_forward(self._module, slots, named, self._leaves, args, kwargs, batch,
                                   functools.partial(self._clip, owners))
        if self.first_step is not None and not self.first_step.started:
            self.first_step.watch(args, kwargs, out, batch)
        return out

    def _check_optimizer(self) -> None:
        if self.max_grad_norm is None:
            raise RuntimeError("batchrules.dp: PrivateModule has no DPOptimizer: create one with "
                               "DPOptimizer(optimizer, module=..., ...) or use "
                               "PrivacyEngine.make_private")

    def _traced_forward(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """The forward while Dynamo traces (Note [The engine under torch.compile]).
        The trainable parameters are the spec's, checked in the traced body:
        Dynamo refuses to wrap an RNN module, as ``named_parameters`` would."""
        spec, counter = self._spec, self._counter
        if not torch.is_grad_enabled() or (spec is not None and not spec.names):
            return self._module(*args, **kwargs)
        self._check_optimizer()
        assert spec is not None and counter is not None  # made with max_grad_norm
        refuse_batch_norm(self._batch_norms)
        out = traced_forward(spec, self._sinks, counter, args, kwargs)
        if self.first_step is not None and not self.first_step.started:
            self.first_step.watch_inputs(args, kwargs, batch_size(args, kwargs))
        return out

    def plain_forwards(self) -> Any:
        """A context for forwards and backwards of the model outside the
        engine (the first-step validation's): FSDP's modules unsharded."""
        self.reshard()
        return plain_forwards(self.fsdp_modules)

    def reshard(self) -> None:
        """Frees FSDP's full parameters once no backward needs them."""
        if self._unsharded:
            reshard(self.fsdp_modules)
            self._unsharded = False

    def _clip(self, owners: List[nn.Parameter], recording: Recording) -> None:
        """Clips one backward's per-sample gradients and adds the sums up."""
        assert self.max_grad_norm is not None
        batch = recording.tape.batch_size
        scale = float(batch) if self.loss_reduction == "mean" else 1.0
        sums, norms = clip(recording.params, batch, self.max_grad_norm, scale)
        for p, s in zip(owners, sums):
            if p in self._sums:
                self._sums[p] += s
            else:
                self._sums[p] = s
        self.per_sample_norms = norms
        self._backwards += 1
        self.reshard()

    def take_clipped_sums(self) -> Dict[nn.Parameter, Tensor]:
        """The clipped sums the backwards since the last call added up (a
        parameter no backward reached has none), and forgets them."""
        sums, self._sums = self._sums, {}
        if self._spec is None:
            return sums
        owners = dict(self.trainable_parameters())
        for name, sink in zip(self._spec.names, self._sinks):  # compiled backwards'
            if sink.grad is not None and name in owners:
                p = owners[name]
                sums[p] = sums[p] + sink.grad if p in sums else sink.grad
            sink.grad = None
        if self._spec.names != tuple(owners):
            self._make_sinks()  # for the parameters as they are now
        return sums

    def take_backward_count(self) -> int:
        """How many backwards were clipped since the last call (the
        optimizer's every step); FSDP's full parameters are freed by then."""
        self.reshard()  # a forward without a backward (an empty batch's) left them full
        count, self._backwards = self._backwards, 0
        if self._counter is not None and self._counter.grad is not None:  # compiled backwards
            count += int(self._counter.grad.item())
            self._counter.grad = None
        return count


def recorded_forward(model: nn.Module, slots: Slots, named: List[Tuple[str, nn.Parameter]],
                     kept: KeptLeaves, args: Tuple[Any, ...], kwargs: Dict[str, Any], batch: int,
                     on_done: Callable[[Recording], None]) -> Any:
    """``model``'s batched forward with ``named`` (held in ``slots``) as
    ``kept``'s intercepted leaves (Note [A batched forward, one vmap per call]);
    ``on_done`` after the backward (Note [The clipping runs at the end of the
    user's backward])."""
    params = kept.params(named)
    tape = Tape(params, batch, -1, batched=True, anchored=True)
    # See Note [The forward's leaves in the parameters' slots] (parameter_slots.py).
    with Interceptor(tape, INTERCEPTS), \
            swapped(slots, [(p, param.leaf) for (_, p), param in zip(named, params)]):
        out = model(*args, **kwargs)
    Recording(tape, params, on_done)
    return out


def batch_size(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> int:
    """Dim 0 of the first tensor among the inputs (the batch's size)."""
    if args and isinstance(args[0], Tensor) and args[0].dim() > 0:  # the common call, model(x)
        return args[0].shape[0]
    for leaf in tree_flatten((args, kwargs))[0]:
        if isinstance(leaf, Tensor) and leaf.dim() > 0:
            return leaf.shape[0]
    raise ValueError("batchrules.dp: the model's inputs hold no tensor with a batch dim (dim 0); "
                     "sample i of a batch must be row i of dim 0 of the inputs")


def batch_norms(module: nn.Module) -> List[Tuple[str, nn.Module]]:
    return [(name, m) for name, m in module.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def refuse_batch_norm(norms: List[Tuple[str, nn.Module]]) -> None:
    """Raises, naming them, for BatchNorm layers (of ``batch_norms``) in
    training mode that update running statistics or have trainable affine
    parameters: their statistics mix the samples of a batch."""
    names = [name for name, m in norms if m.training
             and (m.track_running_stats or any(p.requires_grad for p in m.parameters()))]
    if names:
        raise ValueError(
            f"batchrules.dp: BatchNorm in training mode ({', '.join(names)}): its batch statistics "
            "mix the samples of a batch, so per-sample gradients are not defined. Replace it with "
            "GroupNorm or LayerNorm, or put it in eval mode (frozen statistics)")
