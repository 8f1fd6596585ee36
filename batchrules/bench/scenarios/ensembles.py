"""Model ensembles via stack_module_state + functional_call + vmap: forward
(shared or per-model input) and the training step; the rows at training sizes
are in ``ensembles_scale``."""
import functools
from typing import Any, Callable, Dict, FrozenSet, List, NamedTuple, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from ..baselines import hand_written
from ..case import Case, CaseSetup, Variant, stock_and_batchrules, vmap_identity
from ..models import MlpSpec, in_float64, mlp, mse, stacked_ensemble
from ..targets import Speedup, Target, transform_targets
from . import ensembles_scale

NOT_SMOKE = ensembles_scale.NOT_SMOKE
# Where one batched call wins, ensemble_vmap must measure so and keep it; on
# the small tier its own per-call cost (signature of the inputs) is not noise.
KEEPS_BATCHED = Speedup("ensemble_vmap keeps the batched call's speed (batchrules / ensemble_vmap >= 0.97)",
                        "batchrules", "ensemble_vmap", 0.97)


def ensemble_targets(tier: str) -> List[Target]:
    return [*transform_targets(tier), *([KEEPS_BATCHED] if tier != "small" else [])]


class EnsembleSize(NamedTuple):
    name: str
    tier: str
    members: int
    spec: MlpSpec
    batch: int
    modes: FrozenSet[str]


# MBPO's dynamics ensemble: 7 members, 4 hidden layers of 200 with swish;
# HalfCheetah-sized in/out (obs 17 + action 6 -> mean and log-var of 18). Its
# training step is the headline row.
MBPO = EnsembleSize("mbpo", "medium", 7, MlpSpec((23, 200, 200, 200, 200, 36), "silu"), 256, NOT_SMOKE)
SIZES = (
    EnsembleSize("small", "small", 4, MlpSpec((16, 32, 32, 4)), 8, frozenset({"smoke", "quick", "full"})),
    MBPO,
    # The torch.func model-ensembling tutorial.
    EnsembleSize("tutorial", "medium", 10, MlpSpec((784, 128, 128, 10)), 64, NOT_SMOKE),
    EnsembleSize("large", "large", 8, MlpSpec((128, 512, 512, 128)), 512, frozenset({"full"})),
)


def train_setup(models: Sequence[nn.Module], x: Tensor, y: Tensor,
                limit: Callable[[Dict[str, Tensor]], Callable[[], Any]]) -> CaseSetup:
    """vmap(grad(mse)) over the stacked members, each on its own ``x[e]``,
    ``y[e]``: stock, batchrules and the limit (``limit`` makes its step from the
    stacked parameters), checked against a float64 loop over the members."""
    params, buffers, base = stacked_ensemble(models)
    params = {k: v.detach().to(x.device) for k, v in params.items()}

    def member_loss(p: Dict[str, Tensor], b: Dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return mse(functional_call(base, (p, b), (xi,)), yi)

    ensemble_grads = vmap(grad(member_loss))

    def user_code() -> Dict[str, Tensor]:
        return ensemble_grads(params, buffers, x, y)

    def reference() -> List[Tensor]:
        rows = []
        for e, m in enumerate(models):
            m64 = in_float64(m)
            loss = mse(m64(x[e].cpu().double()), y[e].cpu().double())
            rows.append(torch.autograd.grad(loss, list(m64.parameters())))
        return [torch.stack(g) for g in zip(*rows)]

    floor = vmap_identity((0, 0, 0, 0), (params, buffers, x, y), returned=0)
    return CaseSetup([*stock_and_batchrules(user_code), Variant("limit", limit(params)),
                      ensembles_scale.ensemble_vmap_variant(grad(member_loss), 0, (params, buffers, x, y))],
                     reference, floor=floor)


def _forward_case(size: EnsembleSize, shared: bool) -> Case:
    spec = size.spec

    def build(device: torch.device) -> CaseSetup:
        models = [mlp(spec) for _ in range(size.members)]
        params, buffers, base = stacked_ensemble(models)
        params = {k: v.detach().to(device) for k, v in params.items()}
        in_f = spec.sizes[0]
        x = torch.randn((size.batch, in_f) if shared else (size.members, size.batch, in_f), device=device)
        in_dims = (0, 0, None if shared else 0)

        def forward(p: Dict[str, Tensor], b: Dict[str, Tensor], xi: Tensor) -> Tensor:
            return functional_call(base, (p, b), (xi,))
        ensemble = vmap(forward, in_dims=in_dims)

        def user_code() -> Tensor:
            return ensemble(params, buffers, x)

        def reference() -> Tensor:
            x64 = x.cpu().double()
            return torch.stack([in_float64(m)(x64 if shared else x64[e]) for e, m in enumerate(models)])

        layers = spec.layers(params)
        return CaseSetup([*stock_and_batchrules(user_code), Variant(
            "limit", lambda: hand_written.ensemble_forward(layers, spec.act, x, shared)),
            ensembles_scale.ensemble_vmap_variant(forward, in_dims, (params, buffers, x))],
            reference=reference, floor=vmap_identity(in_dims, (params, buffers, x)))

    return Case("ensemble_fwd_shared" if shared else "ensemble_fwd_per_model", size.name, size.tier,
                spec.n_linears, f"{size.members} MLPs {spec.sizes} ({spec.act}), batch {size.batch}, "
                f"{'shared' if shared else 'per-model'} input", build, ensemble_targets(size.tier))


def _train_case(size: EnsembleSize) -> Case:
    spec = size.spec

    def build(device: torch.device) -> CaseSetup:
        models = [mlp(spec) for _ in range(size.members)]
        x = torch.randn(size.members, size.batch, spec.sizes[0], device=device)
        y = torch.randn(size.members, size.batch, spec.sizes[-1], device=device)
        return train_setup(models, x, y, lambda params: functools.partial(
            hand_written.ensemble_mse_grads, spec.layers(params), spec.act, x, y))

    return Case("ensemble_train", size.name, size.tier, spec.n_linears,
                f"vmap(grad(mse)) over {size.members} MLPs {spec.sizes} ({spec.act}), per-model batch "
                f"{size.batch}", build, ensemble_targets(size.tier))


def cases(mode: str) -> List[Case]:
    """Ensemble forward (shared / per-model input) and training-step cases for a
    mode, then the rows at training sizes (--quick and --full)."""
    if mode == "headline":
        return [_train_case(MBPO)]
    chosen = [s for s in SIZES if mode in s.modes]
    return ([_forward_case(s, True) for s in chosen] + [_forward_case(s, False) for s in chosen]
            + [_train_case(s) for s in chosen] + ensembles_scale.cases(mode))
