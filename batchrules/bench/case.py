"""What a benchmark case is made of: variants of one step and a reference."""
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence

import torch
from torch.func import vmap

import batchrules

# Size tiers: "small" is overhead-bound (targets are looser there).
TIERS = ("small", "medium", "large")
# What a run covers, smallest first (the CLI's --help says what each is); each
# scenario says which of its sizes each mode runs.
MODES = ("smoke", "headline", "quick", "full")


@dataclass
class Variant:
    """One way of computing the step: ``fn`` runs one step and returns its result
    (tensors, or a tuple/list/dict of them) in the order of the case's reference,
    under the batchrules routing state ``routing`` (None: irrelevant, left off).
    ``user_code``: ``fn`` is the user's own code (a plain Python function), which
    gets a compiled twin (Note [Compiled twins]); ``compiled``: for a step
    whose backward Dynamo cannot trace (``loss.backward()`` in the user's
    loop), the twin itself given a backend, its model compiled as its user
    compiles it. ``reference``: this variant's own
    float64 reference (None: the case's); ``rtol``: its own tolerance (None: the
    runner's; a step under bfloat16 autocast)."""

    name: str
    fn: Callable[[], Any]
    routing: Optional[bool] = None
    user_code: bool = False
    compiled: Optional[Callable[[Any], "Variant"]] = None
    reference: Optional[Callable[[], Any]] = None
    rtol: Optional[float] = None

    def context(self) -> ContextManager[None]:
        """The routing state this variant is run (and profiled) under."""
        return batchrules.enabled(bool(self.routing))


@dataclass
class CaseSetup:
    """The materialised case: its variants and a float64 reference result.
    ``floor``: ``vmap`` over a function returning its input, with the case's
    inputs and in_dims: the cost of entering and leaving vmap, which no batching
    rule removes. ``skipped``: variants not built here, and why (Opacus missing)."""

    variants: List[Variant]
    reference: Callable[[], Any]
    notes: List[str] = field(default_factory=list)
    floor: Optional[Callable[[], Any]] = None
    skipped: Dict[str, str] = field(default_factory=dict)


def stock_and_batchrules(fn: Callable[[], Any]) -> List[Variant]:
    """The user's code with routing off ("stock") and on ("batchrules"), each
    with a compiled twin where twins run."""
    return [Variant("stock", fn, routing=False, user_code=True),
            Variant("batchrules", fn, routing=True, user_code=True)]


def vmap_identity(in_dims: Sequence[Any], args: Sequence[Any], returned: int = -1) -> Callable[[], Any]:
    """A step that vmaps a function returning its input ``args[returned]``."""
    identity = vmap(lambda *a: a[returned], in_dims=tuple(in_dims))
    return lambda: identity(*args)


@dataclass
class Case:
    """A scenario at one size; ``build`` allocates its tensors lazily.
    ``targets``: what the scenario promises for this case (``targets.py``'s kinds)."""

    scenario: str
    size: str
    tier: str
    n_linears: int
    description: str
    build: Callable[[torch.device], CaseSetup]
    targets: Sequence[Any] = ()

    @property
    def name(self) -> str:
        return f"{self.scenario}/{self.size}"
