"""``DPOptimizer``: the user's optimizer, stepping with the noised clipped sums."""
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from ..sharded import all_reduce_flat, reduce_scatter_flat
from .module import LOSS_REDUCTIONS, PrivateModule
from .noise import add_gaussian_noise_


class DPOptimizer(Optimizer):
    """Wraps ``optimizer`` (any torch optimizer) for DP-SGD, Opacus' DPOptimizer's shape.

    ``step()`` takes the clipped sums the backwards since the last step
    added up (module.py), adds Gaussian noise of std ``noise_multiplier *
    max_grad_norm`` to each, divides by ``expected_batch_size`` (times the
    number of backwards since the last ``step()``, skipped or not) for ``loss_reduction="mean"``,
    writes them to ``p.grad`` and steps the wrapped optimizer. After
    ``signal_skip_step()`` the next step only keeps the sums (a logical batch
    in physical pieces: BatchMemoryManager). With ``process_group`` (DDP) the
    sums are summed over its ranks in one all-reduce, the noise drawn once,
    on its first rank; on an FSDP2 model, reduce-scattered onto the shards
    (Note [The engine on an FSDP2 model] in fsdp.py).

    The noise generator's state is not in ``state_dict()`` (the wrapped
    optimizer's): PrivacyEngine's checkpoints save it.
    """

    def __init__(self, optimizer: Optimizer, *, module: PrivateModule, noise_multiplier: float,
                 max_grad_norm: float, expected_batch_size: Optional[int],
                 loss_reduction: str = "mean", generator: Optional[torch.Generator] = None,
                 secure_mode: bool = False, process_group: Optional[Any] = None) -> None:
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"batchrules.dp: loss_reduction must be 'mean' or 'sum', got "
                             f"{loss_reduction!r}")
        if loss_reduction == "mean" and (expected_batch_size is None or expected_batch_size <= 0):
            raise ValueError("batchrules.dp: loss_reduction='mean' needs expected_batch_size > 0, "
                             f"got {expected_batch_size!r}")
        if not noise_multiplier >= 0:
            raise ValueError(f"batchrules.dp: noise_multiplier must be >= 0, got {noise_multiplier!r}")
        if not 0 < max_grad_norm < float("inf"):
            raise ValueError(f"batchrules.dp: max_grad_norm must be a finite number > 0, got "
                             f"{max_grad_norm!r}")
        if module.loss_reduction != loss_reduction:
            raise ValueError(f"batchrules.dp: the module's loss_reduction {module.loss_reduction!r} "
                             f"differs from the optimizer's {loss_reduction!r}")
        owned = {p for _, p in module.trainable_parameters()}
        stray = [i for g in optimizer.param_groups for i, p in enumerate(g["params"])
                 if p.requires_grad and p not in owned]
        if stray:
            raise ValueError("batchrules.dp: the optimizer holds trainable parameters that are not "
                             "the module's; they would be updated without privacy")
        self.original_optimizer = optimizer
        self.module = module
        self.noise_multiplier = float(noise_multiplier)
        self.max_grad_norm = float(max_grad_norm)
        self.expected_batch_size = expected_batch_size
        self.loss_reduction = loss_reduction
        self.generator = generator
        self.secure_mode = secure_mode
        self.process_group = process_group
        self.step_hooks: List[Callable[["DPOptimizer"], None]] = []
        self._skip_queue: List[bool] = []
        module.max_grad_norm = self.max_grad_norm

    # The wrapped optimizer's state is this one's (schedulers, checkpoints).
    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: List[Dict[str, Any]]) -> None:
        self.original_optimizer.param_groups = groups

    @property
    def state(self) -> Any:
        return self.original_optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        self.original_optimizer.state = state

    @property
    def defaults(self) -> Dict[str, Any]:
        return self.original_optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: Dict[str, Any]) -> None:
        self.original_optimizer.defaults = defaults

    def __repr__(self) -> str:
        return f"DPOptimizer({self.original_optimizer!r})"

    def state_dict(self) -> Dict[str, Any]:
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.original_optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original_optimizer.zero_grad(set_to_none)

    def signal_skip_step(self, do_skip: bool = True) -> None:
        """The next ``step()`` only keeps the clipped sums (no noise, no update)."""
        self._skip_queue.append(do_skip)

    def attach_step_hook(self, fn: Callable[["DPOptimizer"], None]) -> None:
        """``fn(self)`` after every step that updates (the accountant's)."""
        self.step_hooks.append(fn)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        first = self.module.first_step
        if first is not None and first.pending():
            first.check(self.module)  # before any update
        # Opacus' accumulated iterations: the backwards since the last step, skipped or not
        backwards = self.module.take_backward_count()
        if self._skip_queue and self._skip_queue.pop(0):
            return loss  # the module keeps adding the clipped sums up
        self._update(self.module.take_clipped_sums(), backwards)
        self.original_optimizer.step()
        for hook in self.step_hooks:
            hook(self)
        return loss

    def _update(self, clipped: Dict[nn.Parameter, Tensor], backwards: int) -> None:
        """``p.grad``: the clipped sum plus noise, scaled (noise only: no sum)."""
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        sharded = bool(self.module.fsdp_modules)  # Note [The engine on an FSDP2 model] in fsdp.py
        sums = [clipped[p] if p in clipped else _zeros(p, sharded) for p in params]
        group = params[0].device_mesh.get_group() if sharded and params else self.process_group
        first_rank = group is None or torch.distributed.get_rank(group) == 0
        std = self.noise_multiplier * self.max_grad_norm
        if std > 0 and first_rank:
            sums = [add_gaussian_noise_(s, std, self.generator, self.secure_mode) for s in sums]
        if sharded:
            names = {p: n for n, p in self.module.trainable_parameters()}
            shards = reduce_scatter_flat({names[p]: s for p, s in zip(params, sums)},
                                         {names[p]: p for p in params})
            sums = [shards[names[p]] for p in params]
        elif self.process_group is not None:
            sums = all_reduce_flat(sums, self.process_group)
        denominator = 1.0
        if self.loss_reduction == "mean":
            assert self.expected_batch_size is not None
            denominator = float(self.expected_batch_size * max(backwards, 1))
        for p, s in zip(params, sums):  # the sums are this step's own: scaled in place
            s = s.div_(denominator) if denominator != 1.0 else s
            if not sharded:  # a sum in the parameter's dtype and shape already, as a rule
                s = s if s.dtype == p.dtype else s.to(p.dtype)
                s = s if s.shape == p.shape else s.view_as(p)
            p.grad = s


def _zeros(p: Tensor, sharded: bool) -> Tensor:
    """A zero clipped sum of ``p``: full-size for an FSDP shard (a DTensor)."""
    if not sharded:
        return torch.zeros_like(p)
    local = p.to_local()  # type: ignore[attr-defined]
    return torch.zeros(p.shape, dtype=local.dtype, device=local.device)
