"""Every torch.func transform over one small float64 model (3 -> 2 features):
the calls the routing tests run with routing on and off."""
from typing import Callable, Dict

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

X = torch.randn(5, 3, dtype=torch.float64)

# The transforms that differentiate in reverse mode (so run the ops' backward).
REVERSE_MODE = frozenset({"grad", "vjp", "jacrev", "hessian", "vmap_grad"})


def transforms(model: nn.Module) -> Dict[str, Callable[[], object]]:
    """name -> a call of that transform over ``model`` (input [3], output [2])."""
    params = {k: p.detach() for k, p in model.named_parameters()}

    def out(x: Tensor) -> Tensor:
        return functional_call(model, params, (x,))

    def scalar(x: Tensor) -> Tensor:
        return out(x).pow(2).sum()

    def param_loss(p: Dict[str, Tensor], x: Tensor) -> Tensor:
        return functional_call(model, p, (x,)).pow(2).sum()

    return {
        "vmap": lambda: vmap(out)(X),
        "vmap_vmap": lambda: vmap(vmap(out))(X.reshape(1, 5, 3).expand(2, 5, 3)),
        "grad": lambda: grad(scalar)(X[0]),
        "vjp": lambda: vjp(out, X[0])[1](torch.ones(2, dtype=torch.float64)),
        "jvp": lambda: jvp(out, (X[0],), (torch.ones(3, dtype=torch.float64),)),
        "jacrev": lambda: jacrev(out)(X[0]),
        "jacfwd": lambda: jacfwd(out)(X[0]),
        "hessian": lambda: hessian(scalar)(X[0]),
        "vmap_grad": lambda: vmap(grad(param_loss), in_dims=(None, 0))(params, X),
    }
