"""Model ensembles via stack_module_state + functional_call + vmap: forward
(shared or per-model input) and the training step."""
from dataclasses import dataclass
from typing import Dict, FrozenSet, List

import torch
from torch import Tensor
from torch.func import functional_call, grad, vmap

from ..baselines import hand_written
from ..case import Case, CaseSetup, Variant, vmap_identity
from ..models import MlpSpec, in_float64, mlp, mse, stacked_ensemble
from ..targets import transform_targets

ALL, NOT_SMOKE, FULL = frozenset({"smoke", "quick", "full"}), frozenset({"quick", "full"}), frozenset({"full"})


@dataclass(frozen=True)
class EnsembleSize:
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
    EnsembleSize("small", "small", 4, MlpSpec((16, 32, 32, 4)), 8, ALL),
    MBPO,
    # The torch.func model-ensembling tutorial.
    EnsembleSize("tutorial", "medium", 10, MlpSpec((784, 128, 128, 10)), 64, NOT_SMOKE),
    EnsembleSize("large", "large", 8, MlpSpec((128, 512, 512, 128)), 512, FULL),
)


def _layers(params: Dict[str, Tensor], spec: MlpSpec) -> List[hand_written.Layer]:
    return [tuple(params[k] for k in spec.param_keys(i)) for i in range(spec.n_linears)]


def _forward_case(size: EnsembleSize, shared: bool) -> Case:
    def build(device: torch.device) -> CaseSetup:
        models = [mlp(size.spec) for _ in range(size.members)]
        params, buffers, base = stacked_ensemble(models)
        params = {k: v.detach().to(device) for k, v in params.items()}
        in_f = size.spec.sizes[0]
        shape = (size.batch, in_f) if shared else (size.members, size.batch, in_f)
        x = torch.randn(shape, device=device)

        def member(p: Dict[str, Tensor], b: Dict[str, Tensor], xi: Tensor) -> Tensor:
            return functional_call(base, (p, b), (xi,))

        in_dims = (0, 0, None if shared else 0)
        ensemble = vmap(member, in_dims=in_dims)
        layers = _layers(params, size.spec)

        def reference() -> Tensor:
            x64 = x.cpu().double()
            return torch.stack(
                [in_float64(m)(x64 if shared else x64[e]) for e, m in enumerate(models)]
            )

        def user_code() -> Tensor:
            return ensemble(params, buffers, x)

        return CaseSetup(
            variants=[
                Variant("stock", user_code, routing=False, user_code=True),
                Variant("batchrules", user_code, routing=True, user_code=True),
                Variant("limit", lambda: hand_written.ensemble_forward(layers, size.spec.act, x, shared)),
            ],
            reference=reference,
            floor=vmap_identity(in_dims, (params, buffers, x)),
        )

    kind = "shared input" if shared else "per-model input"
    return Case(
        scenario="ensemble_fwd_shared" if shared else "ensemble_fwd_per_model",
        size=size.name,
        tier=size.tier,
        n_linears=size.spec.n_linears,
        description=f"{size.members} MLPs {size.spec.sizes} ({size.spec.act}), batch {size.batch}, {kind}",
        build=build,
        targets=transform_targets(size.tier),
    )


def _train_case(size: EnsembleSize) -> Case:
    def build(device: torch.device) -> CaseSetup:
        models = [mlp(size.spec) for _ in range(size.members)]
        params, buffers, base = stacked_ensemble(models)
        params = {k: v.detach().to(device) for k, v in params.items()}
        x = torch.randn(size.members, size.batch, size.spec.sizes[0], device=device)
        y = torch.randn(size.members, size.batch, size.spec.sizes[-1], device=device)

        def member_loss(p: Dict[str, Tensor], b: Dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
            return mse(functional_call(base, (p, b), (xi,)), yi)

        in_dims = (0, 0, 0, 0)
        ensemble_grads = vmap(grad(member_loss), in_dims=in_dims)
        layers = _layers(params, size.spec)

        def reference() -> List[Tensor]:
            per_member = []
            for e, m in enumerate(models):
                m64 = in_float64(m)
                loss = mse(m64(x[e].cpu().double()), y[e].cpu().double())
                per_member.append(torch.autograd.grad(loss, list(m64.parameters())))
            return [torch.stack(g) for g in zip(*per_member)]

        def user_code() -> Dict[str, Tensor]:
            return ensemble_grads(params, buffers, x, y)

        return CaseSetup(
            variants=[
                Variant("stock", user_code, routing=False, user_code=True),
                Variant("batchrules", user_code, routing=True, user_code=True),
                Variant("limit", lambda: hand_written.ensemble_mse_grads(layers, size.spec.act, x, y)),
            ],
            reference=reference,
            floor=vmap_identity(in_dims, (params, buffers, x, y), returned=0),
        )

    return Case(
        scenario="ensemble_train",
        size=size.name,
        tier=size.tier,
        n_linears=size.spec.n_linears,
        description=(
            f"vmap(grad(mse)) over {size.members} MLPs {size.spec.sizes} ({size.spec.act}), "
            f"per-model batch {size.batch}"
        ),
        build=build,
        targets=transform_targets(size.tier),
    )


def cases(mode: str) -> List[Case]:
    """Ensemble forward (shared / per-model input) and training-step cases for a mode."""
    if mode == "headline":
        return [_train_case(MBPO)]
    chosen = [s for s in SIZES if mode in s.modes]
    return (
        [_forward_case(s, shared=True) for s in chosen]
        + [_forward_case(s, shared=False) for s in chosen]
        + [_train_case(s) for s in chosen]
    )
