"""The engine's first-step validation: the batched forward against samples run one at a time.

Note [Validating the batched forward]
A batched forward cannot prove that the model keeps samples apart, nor that
its reading of shapes (Note [A batched forward, one vmap per call]) is right
for this model; vmap could. So the first step, before any update, checks it
on two samples of the first batch (the first and the last): the gradient
that reached the model's batched outputs in the user's backward is a fixed
cotangent per sample; the two samples are run as a batch of two through the
engine and each alone through the plain model, and each parameter's per-sample
gradient norm must agree. The engine's norms are those the clipping forms: a
parameter whose uses are one rule's weight uses takes its rule's norm (from
the recorded inputs and output gradients, no per-sample gradient formed),
any other its materialized per-sample gradient's. Both runs are in eval mode
(dropout off: the masks of a batch and of a single sample differ) with the
random state restored after, so that the check changes neither the training
nor its random stream. A model whose outputs hold no batched tensor that
requires grad cannot be checked: a warning says so. A compiled forward (Note
[The engine under torch.compile] in compiled_forward.py) keeps its inputs but
cannot hook its outputs: the cotangents are then drawn at random, which
checks the same. ``validate=False`` skips the check.
"""
import contextlib
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils._pytree import tree_flatten, tree_map

from ..clipping import factored_norms_sq, per_sample_grad
from ..tape import Param
from .parameter_slots import parameter_slots
from .recording import Recording

_RTOL = {torch.float64: 1e-6, torch.float32: 1e-3}


class FirstStep:
    """What the first forward's validation needs, and its state."""

    def __init__(self) -> None:
        self.started = self.done = False
        self.inputs: Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]] = None
        self.batch = 0
        self.cotangents: Dict[int, Tensor] = {}  # output leaf index -> its gradient
        self.drawn = False  # the cotangents are drawn at random (a compiled forward's)

    def watch(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, batch: int) -> None:
        """Keeps the first forward's inputs and, through hooks, its outputs' gradients."""
        self.started, self.inputs, self.batch = True, (args, kwargs), batch
        for i, t in enumerate(tree_flatten(out)[0]):
            if _batched(t, batch) and t.requires_grad:
                t.register_hook(self._keeper(i))

    def watch_inputs(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], batch: int) -> None:
        """Keeps the first compiled forward's inputs; the cotangents are
        then drawn at random (Note [Validating the batched forward])."""
        self.started, self.inputs, self.batch, self.drawn = True, (args, kwargs), batch, True

    def _keeper(self, i: int) -> Any:
        def keep(grad: Tensor) -> None:
            self.cotangents[i] = grad
        return keep

    def pending(self) -> bool:
        return self.started and not self.done

    def check(self, module: Any) -> None:
        """Raises, naming the parameters, where the norms disagree."""
        self.done = True
        inputs, batch = self.inputs, self.batch
        self.inputs = None
        if batch < 2:
            return
        assert inputs is not None
        picked = torch.tensor([0, batch - 1])
        # the picked samples' cotangents, [2, ...]; drawn after the batched forward
        cotangents = {i: c[picked.to(c.device)] for i, c in self.cotangents.items()}
        self.cotangents = {}
        if not cotangents and not self.drawn:
            _warn_unchecked()
            return
        model: nn.Module = module._module
        with module.plain_forwards(), _quiet(model, [p for _, p in module.trainable_parameters()]):
            named = module.trainable_parameters()  # FSDP's full ones in the context
            both = _engine_norms(model, named, _rows(inputs, picked, batch), cotangents)
            if not cotangents:
                _warn_unchecked()
                return
            alone = [_plain_norms(model, named, _rows(inputs, picked[j:j + 1], batch),
                                  cotangents, j) for j in range(2)]
        named = module.trainable_parameters()
        engine = [n.tolist() for n in both]  # [parameter][sample]
        totals = [sum(n[j] ** 2 for n in engine) ** 0.5 for j in range(2)]
        differ = []
        for k, (name, p) in enumerate(named):
            rtol = _RTOL.get(p.dtype, 2e-2)
            for j in range(2):
                e, s = engine[k][j], alone[j][k]
                if abs(e - s) > rtol * max(e, s) + rtol * 1e-2 * totals[j]:
                    differ.append(f"{name} (sample {int(picked[j])}: {e:.6g} batched, "
                                  f"{s:.6g} alone)")
                    break
        if differ:
            raise RuntimeError(
                "batchrules.dp: the first-step validation found per-sample gradient norms that "
                "differ between the batched forward and samples run one at a time, for "
                f"{'; '.join(differ[:3])}{' and others' if len(differ) > 3 else ''}. The model "
                "mixes samples of a batch (a statistic over dim 0, a BatchNorm), or holds the batch "
                "elsewhere than dim 0 of its inputs; per-sample clipping would be wrong. No update "
                "was made")


def _warn_unchecked() -> None:
    warnings.warn("batchrules.dp: the first-step validation could not run: no batched output of "
                  "the model received a gradient (a loss computed inside the model?); its batched "
                  "forward is unchecked", stacklevel=4)


def _batched(t: Any, batch: int) -> bool:
    return isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == batch


def _rows(inputs: Tuple[Tuple[Any, ...], Dict[str, Any]], picked: Tensor, batch: int) -> Any:
    """The inputs of the picked samples (tensors of the batch indexed on dim 0)."""
    return tree_map(lambda t: t[picked.to(t.device)] if _batched(t, batch) else t, inputs)


@contextlib.contextmanager
def _quiet(model: nn.Module, params: List[nn.Parameter]) -> Iterator[None]:
    """Eval mode, grad on, and the random state restored after (see the Note)."""
    modes = {m: m.training for m in model.modules()}
    devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            model.eval()
            yield
    finally:
        for m, training in modes.items():
            m.training = training


def _outputs(out: Any, cotangents: Dict[int, Tensor],
             rows: slice) -> Tuple[List[Tensor], List[Tensor]]:
    leaves = tree_flatten(out)[0]
    indices = sorted(cotangents)
    return [leaves[i] for i in indices], [cotangents[i][rows] for i in indices]


def _engine_norms(model: nn.Module, named: List[Tuple[str, nn.Parameter]], inputs: Any,
                  cotangents: Dict[int, Tensor]) -> List[Tensor]:
    """Each parameter's per-sample gradient norms ``[2]`` through the engine;
    ``cotangents`` drawn here if empty (a compiled forward's)."""
    from .kept_leaves import KeptLeaves
    from .module import recorded_forward  # module.py imports this file

    norms: List[Tensor] = []

    def done(recording: Recording) -> None:
        norms.extend(_sample_norms(p) for p in recording.params)

    out = recorded_forward(model, parameter_slots(model), named, KeptLeaves(), inputs[0], inputs[1],
                           2, done)
    if not cotangents:
        cotangents.update({i: torch.randn_like(t) for i, t in enumerate(tree_flatten(out)[0])
                           if _batched(t, 2) and t.requires_grad and t.is_floating_point()})
        if not cotangents:
            return []
    outs, cots = _outputs(out, cotangents, slice(None))
    torch.autograd.backward(outs, cots)
    if not norms:  # no use reached the outputs
        return [torch.zeros(2) for _ in named]
    return norms


def _sample_norms(p: Param) -> Tensor:
    """``[2]``: ``p``'s per-sample gradient norms as the clipping forms them (see the Note)."""
    squares = factored_norms_sq(p)
    if squares is not None:
        return squares.clamp(min=0).sqrt()
    return per_sample_grad(p, 2).flatten(1).norm(dim=1)


def _plain_norms(model: nn.Module, named: List[Tuple[str, nn.Parameter]], inputs: Any,
                 cotangents: Dict[int, Tensor], j: int) -> List[float]:
    """Each parameter's gradient norm for sample ``j`` of the two, through the plain model."""
    leaves = {n: p.detach().requires_grad_() for n, p in named}
    out = functional_call(model, leaves, inputs[0], inputs[1], strict=False)
    outs, cots = _outputs(out, cotangents, slice(j, j + 1))
    grads = torch.autograd.grad(outs, list(leaves.values()), cots, allow_unused=True)
    return [0.0 if g is None else float(g.norm()) for g in grads]
