"""The bench's scenarios. Each module's ``cases(mode)`` returns its cases for a
mode (``case.MODES``), each with the targets the scenario sets for it."""
from typing import List

from ..case import Case
from . import (
    dp_bf16,
    dp_step,
    dp_third_party,
    eager_activations,
    eager_linear,
    ensembles,
    hypernetwork,
    loss_grads,
    per_sample_grads,
    recurrent,
    transformer,
)

# In the order the table shows them (dp_third_party: --full only).
MODULES = (ensembles, per_sample_grads, hypernetwork, eager_linear, transformer, recurrent, loss_grads,
           dp_step, dp_bf16, eager_activations, dp_third_party)


def all_cases(mode: str) -> List[Case]:
    return [case for module in MODULES for case in module.cases(mode)]
