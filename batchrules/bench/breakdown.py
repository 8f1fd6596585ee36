"""``python -m batchrules.bench.breakdown``: where a vmapped step's time goes.

The bench's rows compare whole steps. This peels the torch.func user code of
three ensemble steps (routing on) layer by layer, timed interleaved in one
process, to show which part of the gap to the hand-written limit is
``linear`` and which is torch.func itself:

- ``vmap identity``: vmap over a function returning its input, same inputs;
- ``vmap(grad) trivial``: the same transforms over a body that only sums the
  parameters (what grad's wrapping and its autograd pass cost);
- ``+ functional_call``: functional_call on a module that returns its input;
- ``direct F.linear``: the network written with F.linear on the parameter dict
  (no functional_call);
- ``user code``: the bench's row; ``limit``: the hand-written code.

For SiLU training steps it also reports, from the profiler, what the SiLU
backward nodes cost per step: stock (autograd's twice-differentiable
composite, picked because functorch's grad runs with create_graph=True),
routed (``batchrules.silu_backward``, one kernel) and the limit's
``silu_backward`` kernels.
"""
import argparse
import copy
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.profiler import ProfilerActivity, profile

import batchrules

from .baselines import hand_written
from .case import Variant
from .kernels import quiet_stderr
from .models import MlpSpec, mlp, mse, stacked_ensemble
from .report import fmt_time
from .timing import TimingPlan, time_interleaved

PLAN = TimingPlan(block_s=0.02, budget_s=3.0, min_repeats=7, max_repeats=41, warmup_calls=3)
# (name, members, spec, batch, training step?)
STEPS = (
    ("ensemble_fwd_per_model/small", 4, MlpSpec((16, 32, 32, 4)), 8, False),
    ("ensemble_train/tutorial", 10, MlpSpec((784, 128, 128, 10)), 64, True),
    ("ensemble_train/mbpo", 7, MlpSpec((23, 200, 200, 200, 200, 36), "silu"), 256, True),
)


class _Identity(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x


def _direct(spec: MlpSpec, p: Dict[str, Tensor], x: Tensor) -> Tensor:
    h = x
    for i in range(spec.n_linears):
        w, b = (p[k] for k in spec.param_keys(i))
        h = F.linear(h, w, b)
        if i < spec.n_linears - 1:
            h = hand_written.activation(h, spec.act)
    return h


def _variants(members: int, spec: MlpSpec, batch: int, train: bool) -> List[Variant]:
    models = [mlp(spec) for _ in range(members)]
    params, buffers, base = stacked_ensemble(models)
    identity_module = copy.deepcopy(base)
    identity_module.forward = _Identity().forward  # same parameters, no compute
    x = torch.randn(members, batch, spec.sizes[0])
    y = torch.randn(members, batch, spec.sizes[-1])
    layers = [tuple(params[k] for k in spec.param_keys(i)) for i in range(spec.n_linears)]
    args = (params, buffers, x, y)

    def on(name: str, fn: Callable) -> Variant:
        return Variant(name, lambda: fn(*args), routing=True)

    steps: List[Tuple[str, Callable]] = [("vmap identity", vmap(lambda p, b, xi, yi: xi))]
    if not train:
        steps += [
            ("+ functional_call",
             vmap(lambda p, b, xi, yi: functional_call(identity_module, (p, b), (xi,)))),
            ("direct F.linear", vmap(lambda p, b, xi, yi: _direct(spec, p, xi))),
            ("user code", vmap(lambda p, b, xi, yi: functional_call(base, (p, b), (xi,)))),
        ]
        limit = lambda: hand_written.ensemble_forward(layers, spec.act, x, shared=False)  # noqa: E731
    else:
        steps += [
            ("vmap(grad) trivial",
             vmap(grad(lambda p, b, xi, yi: sum(v.sum() for v in p.values())))),
            ("direct F.linear", vmap(grad(lambda p, b, xi, yi: mse(_direct(spec, p, xi), yi)))),
            ("user code",
             vmap(grad(lambda p, b, xi, yi: mse(functional_call(base, (p, b), (xi,)), yi)))),
        ]
        limit = lambda: hand_written.ensemble_mse_grads(layers, spec.act, x, y)  # noqa: E731
    return [on(name, fn) for name, fn in steps] + [Variant("limit", limit)]


def _self_time_under(variant: Variant, name: str) -> Optional[float]:
    """Seconds per step spent in ``name`` events (children included), from the profiler."""
    variant.fn()
    with variant.context(), quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            variant.fn()
    events = [e for e in prof.events() if e.name == name]
    return sum(e.cpu_time_total for e in events) / 3 * 1e-6 if events else None


def run(steps=STEPS, plan: TimingPlan = PLAN) -> List[str]:
    lines = []
    for name, members, spec, batch, train in steps:
        variants = _variants(members, spec, batch, train)
        stats = time_interleaved(variants, plan, lambda: None)
        limit = stats["limit"].median
        lines.append(f"{name}: {members} x MLP {spec.sizes} ({spec.act}), batch {batch}")
        for v in variants:
            median = stats[v.name].median
            lines.append(f"  {v.name:26s} {fmt_time(median):>10s}  {median / limit:5.2f}x limit")
        if spec.act == "silu" and train:
            user, lim = variants[-2], variants[-1]
            stock = Variant(user.name, user.fn, routing=False)
            stock_grad = _self_time_under(stock, "SiluBackward0")
            routed_grad = _self_time_under(user, "BatchrulesSiluBackward0")
            kernel = _self_time_under(lim, "aten::silu_backward")
            lines.append(f"  SiLU backward per step (profiler): {fmt_time(stock_grad)} stock under "
                         f"grad (create_graph composite), {fmt_time(routed_grad)} routed "
                         f"(batchrules.silu_backward), {fmt_time(kernel)} as silu_backward "
                         f"kernels in the limit")
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m batchrules.bench.breakdown", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, help="torch.set_num_threads before running")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batchrules routing on")
    with batchrules.enabled():
        print("\n".join(run()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
