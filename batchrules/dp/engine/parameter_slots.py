"""The model's parameters and where each is held, to run a forward with other
tensors in their place.

Note [The forward's leaves in the parameters' slots]
The engine's forward runs the user's model with each trainable parameter
replaced by its intercepted leaf, as ``functional_call(model, leaves,
strict=False)`` would, with weights tied (one parameter held by several
modules) replaced together. ``functional_call`` finds the slots afresh at each
call (an untying map over every parameter and buffer name, a submodule lookup
per name, checks per swap): a fixed cost per forward on the order of the
tiny model's own forward. One walk over the modules gives both what
``named_parameters()`` gives (the trainable parameters' names, a tied one
under its first name) and every slot ``(module, attribute)`` holding each;
the swap is then a dict store per slot, undone in the reverse order also when
the forward raises. The walk runs every forward, so a parameter replaced,
frozen, tied or untied since the last one is seen as ``named_parameters``
would see it.
"""
import contextlib
from typing import Dict, Iterator, List, NamedTuple, Tuple

from torch import Tensor, nn


class Slots(NamedTuple):
    """A model's parameters in ``named_parameters()`` order, each with the
    ``(module, attribute)`` slots that hold it."""
    named: List[Tuple[str, nn.Parameter]]
    held_in: Dict[int, List[Tuple[nn.Module, str]]]  # by the parameter's id

    def trainable(self) -> List[Tuple[str, nn.Parameter]]:
        """The parameters that require grad, by name (a tied one once)."""
        return [(n, p) for n, p in self.named if p.requires_grad]


def parameter_slots(model: nn.Module) -> Slots:
    named: List[Tuple[str, nn.Parameter]] = []
    held_in: Dict[int, List[Tuple[nn.Module, str]]] = {}
    for prefix, module in model.named_modules():
        for attribute, p in module._parameters.items():
            if p is None:
                continue
            slots = held_in.get(id(p))
            if slots is None:
                named.append((f"{prefix}.{attribute}" if prefix else attribute, p))
                slots = held_in[id(p)] = []
            slots.append((module, attribute))
    return Slots(named, held_in)


@contextlib.contextmanager
def swapped(slots: Slots, replacements: List[Tuple[nn.Parameter, Tensor]]) -> Iterator[None]:
    """Within the block each parameter's slots hold its replacement (See Note
    [The forward's leaves in the parameters' slots])."""
    saved: List[Tuple[nn.Module, str, nn.Parameter]] = []
    try:
        for p, value in replacements:
            for module, attribute in slots.held_in[id(p)]:
                saved.append((module, attribute, p))
                module._parameters[attribute] = value  # type: ignore[assignment]
        yield
    finally:
        for module, attribute, p in reversed(saved):
            module._parameters[attribute] = p
