"""Check that ``nn.Linear`` under torch.func runs ``batchrules::linear``.

The profiler records every dispatched operator and every autograd node, so
counting the events whose name mentions batchrules shows which path ran.

    python -m batchrules.examples.inspect_routing
"""
from collections import Counter
from typing import Any, Callable, Dict

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import batchrules


def batchrules_op_counts(fn: Callable[..., Any], *args: Any) -> Dict[str, int]:
    """Run ``fn(*args)`` under the profiler; count the events naming batchrules.

    Operator events are ``batchrules::linear`` / ``batchrules::linear_backward``;
    backward passes add autograd node events such as ``BatchrulesLinearBackward0``.
    """
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(*args)
    return dict(Counter(e.name for e in prof.events() if "batchrules" in e.name.lower()))


def main() -> None:
    """Print the batchrules events of vmap(grad) over an nn.Linear, routing on and off."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    params = dict(model.named_parameters())
    x, y = torch.randn(4, 3), torch.randn(4, 2)

    def loss(p: Dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return (functional_call(model, p, (xi,)) - yi).pow(2).sum()

    per_sample_grads = vmap(grad(loss), in_dims=(None, 0, 0))
    for on in (True, False):
        with batchrules.enabled(on):
            counts = batchrules_op_counts(per_sample_grads, params, x, y)
            print(f"routing {'on ' if on else 'off'}:", counts)
    with batchrules.enabled():
        print("eager, routing on:", batchrules_op_counts(model, x))


if __name__ == "__main__":
    main()
