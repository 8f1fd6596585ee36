"""``ensemble_vmap``: vmap over an ensemble's stacked members, run as one batched
call or as a loop over the members, whichever measures faster for the shapes.

Note [Batched members or a member loop]
One batched call over stacked members wins while Python's per-call cost
dominates (small members, GPUs). At training sizes on a CPU it loses to a plain
loop over the members: its temporaries (members x batch x hidden floats) leave
the cache and are mapped afresh by malloc every step, so the memory-bound passes
between the GEMMs (bias, activations and their backward, copies) run several
times slower per element than one member's, which stay in cache. Which side
of that line a call falls on depends on the machine's caches and allocator as
much as on the shapes, so ``ensemble_vmap`` measures instead of guessing: the
first calls with a given input signature time the two in blocks of consecutive
calls, batched, members, members, batched (drift between blocks cancels), and
the one of the lower median time serves every later call with that signature.
Blocks, because a training loop runs each step after its own previous one: a
call right after the other strategy's finds that one's leftovers in the heap
(the batched call reuses the large blocks the loop left, the loop refaults the
pages glibc trimmed after the batched call), which favoured the batched call
when calls alternated; each block's first call, untimed, absorbs the switch.
The median, not the minimum: the batched call's page faults vary from call to
call, and its fastest call flatters it. Every call, trials included, returns
what ``vmap`` returns.

The loop calls ``func`` on each member's slice of the inputs and stacks the
outputs along ``out_dims``, so it is vmap's semantics without vmap's
BatchedTensors; a ``torch.func.grad`` of a loss runs there as one plain
autograd backward a member (See Note [A member's gradient without
torch.func] in member_grad.py). The first call with a signature is always
the batched one, also with ``strategy="members"``, so what vmap rejects
(random ops with ``randomness="error"``, in-place writes to unbatched tensors,
data-dependent control flow) raises exactly as it does with vmap.
``randomness="same"`` replays one generator state for every member.
"""
import collections
import functools
import statistics
import time
from typing import Any, Callable, Deque, Dict, Hashable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.func import vmap
from torch.utils._pytree import TreeSpec, _broadcast_to_and_flatten, tree_flatten, tree_unflatten

from . import _C
from .member_grad import MemberGrad

STRATEGIES = ("auto", "batched", "members")
# The trial's blocks (the first call is batched), each an untimed call and
# TIMED_PER_BLOCK timed ones (Note [Batched members or a member loop]).
TRIAL_BLOCKS = ("batched", "members", "members", "batched")
TIMED_PER_BLOCK = 2
# Calls with one input signature until its strategy is chosen.
TRIAL_CALLS = len(TRIAL_BLOCKS) * (1 + TIMED_PER_BLOCK)
# Input signatures remembered per function (the oldest dropped).
MAX_SIGNATURES = 64


class _Trial:
    """What is known about calls with one input signature: each leaf's member dim
    and the members' count (``members`` None: the batched call serves them all),
    and, once measured, the faster strategy. ``forced``: the strategy after the
    first (batched) call, instead of measuring."""

    def __init__(self, dims: Optional[List[Optional[int]]], members: Optional[int],
                 forced: Optional[str]) -> None:
        self.dims, self.members, self.forced = dims, members, forced
        blocks = [[(s, False)] + [(s, True)] * TIMED_PER_BLOCK for s in TRIAL_BLOCKS]
        plan = [("batched", False)] if forced else [call for block in blocks for call in block]
        self.plan: Deque[Tuple[str, bool]] = collections.deque(plan)
        self.times: Dict[str, List[float]] = {}
        self.choice: Optional[str] = "batched" if members is None else None

    def next(self) -> Tuple[str, bool]:
        if self.choice is not None or not self.plan:
            return self.choice or "batched", False
        return self.plan[0]

    def record(self, strategy: str, timed: bool, seconds: float) -> None:
        if self.choice is not None or not self.plan:  # calls from several threads may overlap
            return
        self.plan.popleft()
        if timed:
            self.times.setdefault(strategy, []).append(seconds)
        if not self.plan:
            self.choice = self.forced or min(self.times, key=lambda k: statistics.median(self.times[k]))


class EnsembleVmap:
    """What ``ensemble_vmap`` returns: callable as the vmapped function."""

    def __init__(self, func: Callable[..., Any], in_dims: Any, out_dims: Any, randomness: str,
                 strategy: str) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"ensemble_vmap: strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.func, self.in_dims, self.out_dims, self.randomness = func, in_dims, out_dims, randomness
        self.requested = strategy
        self.batched = vmap(func, in_dims, out_dims, randomness)
        # See Note [A member's gradient without torch.func] (member_grad.py).
        self.member_grad = MemberGrad.of(func)
        # vmap's None out_dims (an unbatched output) has no member loop
        self.loopable = strategy != "batched" and all(isinstance(d, int) for d in tree_flatten(out_dims)[0])
        self.trials: "collections.OrderedDict[Hashable, _Trial]" = collections.OrderedDict()
        functools.update_wrapper(self, func)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.loopable or _inside_transform():
            return self.batched(*args, **kwargs)
        leaves, spec = tree_flatten(args)
        trial = self._trial(leaves, spec, kwargs)
        chosen, timed = trial.next()
        start = time.perf_counter()
        if chosen == "batched":
            out = self.batched(*args, **kwargs)
        else:
            out = self._member_loop(leaves, spec, kwargs, trial)
        trial.record(chosen, timed, time.perf_counter() - start)
        return out

    def strategy(self, *args: Any, **kwargs: Any) -> Optional[str]:
        """The strategy that calls with these arguments' signature use: the forced
        one or the one measured faster; None before their first call and while measuring."""
        if not self.loopable:
            return "batched"
        leaves, spec = tree_flatten(args)
        trial = self.trials.get(_signature(leaves, spec, kwargs))
        return None if trial is None else trial.choice

    def _trial(self, leaves: List[Any], spec: TreeSpec, kwargs: Dict[str, Any]) -> _Trial:
        """The trial of these inputs' signature, created on its first call (the oldest dropped)."""
        key = _signature(leaves, spec, kwargs)
        trial = self.trials.get(key)
        if trial is None:
            dims = _broadcast_to_and_flatten(self.in_dims, spec)
            members = None if dims is None else _member_count(leaves, dims)
            if members == 0 or not all(t.device.type == "cpu" for t in _tensors(leaves, kwargs)):
                members = None  # nothing to loop over, or GPUs: one launch beats E
            trial = _Trial(dims, members, None if self.requested == "auto" else self.requested)
            if len(self.trials) == MAX_SIGNATURES:
                self.trials.popitem(last=False)
            self.trials[key] = trial
        return trial

    def _member_loop(self, leaves: List[Any], spec: TreeSpec, kwargs: Dict[str, Any], trial: _Trial) -> Any:
        """``func`` on each member's slice, the outputs stacked along ``out_dims``."""
        dims, members = trial.dims, trial.members
        assert dims is not None and members is not None  # a trial with members has both
        replay = torch.get_rng_state() if self.randomness == "same" else None
        if self.member_grad is not None:
            call = self.member_grad.bind(leaves, spec, kwargs)
        else:
            def call(member: List[Any]) -> Any:
                return self.func(*tree_unflatten(member, spec), **kwargs)
        outs: List[Any] = []
        for e in range(members):
            if replay is not None:
                torch.set_rng_state(replay)  # See Note [Batched members or a member loop]
            member = [x if d is None else x.select(d, e) for x, d in zip(leaves, dims)]
            outs.append(tree_flatten(call(member)))
        out_spec = outs[0][1]
        out_dims = _broadcast_to_and_flatten(self.out_dims, out_spec)
        if out_dims is None:
            raise ValueError(f"ensemble_vmap: out_dims={self.out_dims!r} does not match the output's "
                             f"structure {out_spec}")
        return tree_unflatten([torch.stack(column, dim=d) for column, d in
                               zip(zip(*(flat for flat, _ in outs)), out_dims)], out_spec)


def ensemble_vmap(func: Callable[..., Any], in_dims: Any = 0, out_dims: Any = 0, randomness: str = "error",
                  *, strategy: str = "auto") -> EnsembleVmap:
    """``torch.func.vmap`` for ensembles: the same arguments, the same results.

    ``func`` runs over the members stacked along ``in_dims`` (e.g. by
    ``torch.func.stack_module_state``), as ``vmap(func, in_dims, out_dims,
    randomness)`` runs it. ``strategy="auto"`` times, on the first calls with
    each input signature, one batched vmap call against a Python loop that
    calls ``func`` on each member's slice and stacks the outputs, and keeps the
    faster (See Note [Batched members or a member loop]); ``"batched"`` and
    ``"members"`` force one. The loop calls ``func`` once per member, so side
    effects in ``func`` happen that often. It runs only at the top level, on
    CPU tensors, with integer ``out_dims``; elsewhere (inside another
    transform, under ``torch.compile``, on GPUs) every call is the batched one.
    ``.strategy(*args)`` says which one calls with those arguments' signature
    use. Each call costs a pass over the arguments' pytree on top of vmap's.

    Example::

        params, buffers = torch.func.stack_module_state(critics)
        step = batchrules.ensemble_vmap(torch.func.grad(member_loss), in_dims=(0, 0, None))
        grads = step(params, buffers, batch)
    """
    return EnsembleVmap(func, in_dims, out_dims, randomness, strategy)


def _inside_transform() -> bool:
    return torch.compiler.is_compiling() or torch._C._functorch.peek_interpreter_stack() is not None


def _member_count(leaves: Sequence[Any], dims: Sequence[Optional[int]]) -> Optional[int]:
    """The members' count, or None where vmap would reject the inputs (it then names why)."""
    sizes = set()
    for leaf, d in zip(leaves, dims):
        if d is not None:
            if not isinstance(leaf, Tensor) or not -leaf.dim() <= d < leaf.dim():
                return None
            sizes.add(leaf.shape[d])
    return sizes.pop() if len(sizes) == 1 else None


def _tensors(leaves: Sequence[Any], kwargs: Dict[str, Any]) -> List[Tensor]:
    return [t for t in [*leaves, *(tree_flatten(kwargs)[0] if kwargs else ())] if isinstance(t, Tensor)]


def _signature(leaves: Sequence[Any], spec: TreeSpec, kwargs: Dict[str, Any]) -> Hashable:
    """What the choice may depend on: the structure, and each tensor's shape, dtype, device and
    whether it requires grad; kwargs' too; grad mode and routing."""
    key: List[Any] = [spec, torch.is_grad_enabled(), _C._routing_enabled()]
    kw_leaves, kw_spec = tree_flatten(kwargs) if kwargs else ([], None)
    for x in [*leaves, *kw_leaves]:
        if isinstance(x, Tensor):
            key += (x.shape, x.dtype, x.device, x.requires_grad)
        else:
            key.append(type(x))
    key.append(kw_spec)
    return tuple(key)
