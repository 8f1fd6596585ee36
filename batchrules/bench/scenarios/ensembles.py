"""Model ensembles via stack_module_state + functional_call + vmap: forward
(shared or per-model input) and the training step."""
from typing import Any, Dict, FrozenSet, List, NamedTuple

import torch
from torch import Tensor
from torch.func import functional_call, grad, vmap

from ..baselines import hand_written
from ..case import Case, CaseSetup, Variant, stock_and_batchrules, vmap_identity
from ..models import MlpSpec, in_float64, mlp, mse, stacked_ensemble
from ..targets import transform_targets

NOT_SMOKE = frozenset({"quick", "full"})


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


def _case(size: EnsembleSize, kind: str) -> Case:
    """``kind``: "shared" or "per_model" input forward, or "train" (vmap(grad(mse)))."""
    spec, train, shared = size.spec, kind == "train", kind == "shared"

    def build(device: torch.device) -> CaseSetup:
        models = [mlp(spec) for _ in range(size.members)]
        params, buffers, base = stacked_ensemble(models)
        params = {k: v.detach().to(device) for k, v in params.items()}
        in_f = spec.sizes[0]
        x = torch.randn((size.batch, in_f) if shared else (size.members, size.batch, in_f), device=device)
        y = torch.randn(size.members, size.batch, spec.sizes[-1], device=device) if train else None
        layers = [tuple(params[k] for k in spec.param_keys(i)) for i in range(spec.n_linears)]

        def member(p: Dict[str, Tensor], b: Dict[str, Tensor], xi: Tensor, *yi: Tensor) -> Tensor:
            out = functional_call(base, (p, b), (xi,))
            return mse(out, yi[0]) if train else out

        in_dims, args = ((0, 0, 0, 0), (params, buffers, x, y)) if train else ((0, 0, None if shared else 0),
                                                                               (params, buffers, x))
        ensemble = vmap(grad(member) if train else member, in_dims=in_dims)

        def user_code() -> Any:
            return ensemble(*args)

        def limit() -> Any:
            if train:
                return hand_written.ensemble_mse_grads(layers, spec.act, x, y)
            return hand_written.ensemble_forward(layers, spec.act, x, shared)

        def reference() -> Any:
            x64 = x.cpu().double()
            if not train:
                return torch.stack([in_float64(m)(x64 if shared else x64[e]) for e, m in enumerate(models)])
            rows = []
            for e, m in enumerate(models):
                m64 = in_float64(m)
                loss = mse(m64(x64[e]), y[e].cpu().double())
                rows.append(torch.autograd.grad(loss, list(m64.parameters())))
            return [torch.stack(g) for g in zip(*rows)]

        return CaseSetup([*stock_and_batchrules(user_code), Variant("limit", limit)], reference=reference,
                         floor=vmap_identity(in_dims, args, returned=0 if train else -1))

    what = {"shared": "shared input", "per_model": "per-model input"}
    description = (f"vmap(grad(mse)) over {size.members} MLPs {spec.sizes} ({spec.act}), per-model batch "
                   f"{size.batch}" if train else
                   f"{size.members} MLPs {spec.sizes} ({spec.act}), batch {size.batch}, {what.get(kind)}")
    return Case("ensemble_train" if train else f"ensemble_fwd_{kind}", size.name, size.tier, spec.n_linears,
                description, build, transform_targets(size.tier))


def cases(mode: str) -> List[Case]:
    """Ensemble forward (shared / per-model input) and training-step cases for a mode."""
    if mode == "headline":
        return [_case(MBPO, "train")]
    return [_case(s, kind) for kind in ("shared", "per_model", "train") for s in SIZES if mode in s.modes]
