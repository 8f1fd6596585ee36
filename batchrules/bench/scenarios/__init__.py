"""The bench's scenarios. Each module's ``cases(mode)`` returns its cases for a
mode (``case.MODES``), each with the targets the scenario sets for it."""
from typing import List

from ..case import Case
from . import (
    dp_bf16,
    dp_engine,
    dp_step,
    dp_third_party,
    eager,
    ensembles,
    hypernetwork,
    loss_grads,
    per_sample_grads,
    recurrent,
    transformer,
)

# In the order the table shows them (dp_bf16 and dp_third_party: --full only).
CASES = (ensembles.cases, per_sample_grads.cases, hypernetwork.cases, eager.linear_cases, transformer.cases,
         recurrent.cases, loss_grads.cases, dp_step.cases, dp_engine.cases, dp_bf16.cases,
         eager.activation_cases, dp_third_party.cases)


def all_cases(mode: str) -> List[Case]:
    return [case for cases in CASES for case in cases(mode)]
