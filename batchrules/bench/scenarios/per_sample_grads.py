"""Per-sample gradients, vmap(grad(loss), in_dims=(None, 0, 0)), against
Opacus' hooks and hand-written code (MLP, CNN)."""
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from ..baselines import hand_written
from ..baselines.opacus_variants import opacus_variant, with_opacus
from ..case import Case, CaseSetup, Variant, stock_and_batchrules, vmap_identity
from ..models import MlpSpec, cross_entropy, detached_params, in_float64, mlp, small_cnn
from ..targets import FASTER_THAN_OPACUS, transform_targets

MLP_SPEC = MlpSpec((784, 512, 512, 10))
# (batch, tier, modes)
MLP_BATCHES = ((8, "small", {"smoke", "quick", "full"}), (32, "medium", {"headline", "quick", "full"}),
               (128, "large", {"quick", "full"}))
CNN_BATCHES = ((8, "small", {"smoke", "quick", "full"}), (32, "medium", {"quick", "full"}),
               (128, "large", {"full"}))
Loss = Callable[[Tensor, Tensor], Tensor]


def per_sample_loop(model: nn.Module, x: Tensor, y: Tensor, loss: Loss = cross_entropy) -> List[Tensor]:
    """float64 reference: one backward per sample, stacked per parameter."""
    m64 = in_float64(model)
    x64, y = x.cpu().double(), y.cpu() if not y.is_floating_point() else y.cpu().double()
    rows = [torch.autograd.grad(loss(m64(x64[i:i + 1]), y[i:i + 1]), list(m64.parameters()))
            for i in range(x.shape[0])]
    return [torch.stack(g) for g in zip(*rows)]


def psg_setup(model: nn.Module, x: Tensor, y: Tensor, limit: Callable[[Dict[str, Tensor]], Any],
              loss: Loss = cross_entropy, opacus: Optional[Callable[[], Variant]] = None) -> CaseSetup:
    """Per-sample gradients of ``loss`` (of one sample made a batch of one):
    stock, batchrules, the limit (on the parameters) and the Opacus variant
    ``opacus`` builds, checked against ``per_sample_loop``."""
    params = detached_params(model)

    def sample_loss(p: Dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return loss(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    per_sample_grads = vmap(grad(sample_loss), in_dims=(None, 0, 0))

    def user_code() -> Dict[str, Tensor]:
        return per_sample_grads(params, x, y)

    setup = CaseSetup([*stock_and_batchrules(user_code), Variant("limit", lambda: limit(params))],
                      reference=lambda: per_sample_loop(model, x, y, loss),
                      floor=vmap_identity((None, 0, 0), (params, x, y), returned=0))
    return setup if opacus is None else with_opacus(setup, ["opacus"], lambda: [opacus()])


def _mlp_case(batch: int, tier: str) -> Case:
    def build(device: torch.device) -> CaseSetup:
        model = mlp(MLP_SPEC).to(device)
        x = torch.randn(batch, MLP_SPEC.sizes[0], device=device)
        y = torch.randint(0, MLP_SPEC.sizes[-1], (batch,), device=device)

        def limit(p: Dict[str, Tensor]) -> List[Tensor]:
            return hand_written.mlp_per_sample_grads(MLP_SPEC.layers(p), MLP_SPEC.act, x, y)

        return psg_setup(model, x, y, limit, opacus=lambda: opacus_variant(model, x, y))

    return Case("psg_mlp", f"b{batch}", tier, MLP_SPEC.n_linears,
                f"per-sample grads, MLP {MLP_SPEC.sizes}, cross-entropy, batch {batch}", build,
                [*transform_targets(tier), FASTER_THAN_OPACUS])


def _cnn_case(batch: int, tier: str) -> Case:
    def build(device: torch.device) -> CaseSetup:
        model = small_cnn().to(device)
        x = torch.randn(batch, 1, 28, 28, device=device)
        y = torch.randint(0, 10, (batch,), device=device)
        return psg_setup(model, x, y, lambda p: hand_written.cnn_per_sample_grads(p, x, y),
                         opacus=lambda: opacus_variant(model, x, y))

    return Case("psg_cnn", f"b{batch}", tier, 2,
                f"per-sample grads, CNN conv5x16-conv5x32-fc64-fc10 on 28x28, batch {batch}", build,
                [*transform_targets(tier), FASTER_THAN_OPACUS])


def cases(mode: str) -> List[Case]:
    """Per-sample-gradient cases (MLP, CNN) for a mode."""
    return ([_mlp_case(b, t) for b, t, m in MLP_BATCHES if mode in m]
            + [_cnn_case(b, t) for b, t, m in CNN_BATCHES if mode in m])
