"""Ensembles at the sizes RL critics and deep ensembles train (members of
hidden 128-512, batch 256-1024): vmap over stacked members next to what a user
writes without vmap, a Python loop over the ``nn.Module``s, stock
``vmap(chunk_size=...)`` and ``batchrules.ensemble_vmap``. --quick runs two
rows and the critics, --full all."""
import functools
from typing import Any, Callable, Dict, FrozenSet, List, NamedTuple, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from ...ensemble import TRIAL_CALLS, ensemble_vmap
from ..baselines import hand_written
from ..case import Case, CaseSetup, Variant, stock_and_batchrules, vmap_identity
from ..models import Critic, MlpSpec, in_float64, mlp, mse, stacked_ensemble
from ..targets import KernelsPerLinear, Speedup, Target

NOT_SMOKE = frozenset({"quick", "full"})


class ScaleRow(NamedTuple):
    """A row at training sizes: members of ``Linear(in, H), act, Linear(H, H),
    act, Linear(H, 1)``, the input shared by the members or one per member."""
    members: int
    batch: int
    hidden: int
    act: str
    shared: bool
    train: bool
    modes: FrozenSet[str]

    @property
    def scenario(self) -> str:
        if self.train:
            return "ensemble_train"
        return "ensemble_fwd_shared" if self.shared else "ensemble_fwd_per_model"

    @property
    def name(self) -> str:
        act = "" if self.act == "relu" else f"_{self.act}"
        inputs = f"_{'shared' if self.shared else 'per_member'}" if self.train else ""
        return f"e{self.members}_b{self.batch}_h{self.hidden}{act}{inputs}"

    @property
    def inputs(self) -> str:
        return "shared" if self.shared else "per-member"


IN_FEATURES = 23  # HalfCheetah's observation 17 + action 6, as MBPO's members
SCALE_ROWS = (
    ScaleRow(10, 1024, 256, "relu", True, True, NOT_SMOKE),
    ScaleRow(10, 1024, 512, "relu", True, True, frozenset({"full"})),
    ScaleRow(10, 1024, 256, "relu", False, True, frozenset({"full"})),
    ScaleRow(32, 512, 128, "relu", True, True, frozenset({"full"})),
    ScaleRow(10, 1024, 256, "silu", True, True, NOT_SMOKE),
    ScaleRow(32, 512, 512, "relu", False, False, frozenset({"full"})),
    ScaleRow(10, 1024, 256, "relu", True, False, frozenset({"full"})),
)
# Stock vmap's own answer to large members: run them in chunks.
CHUNK_SIZES = (1, 4)
SCALE_TARGETS: List[Target] = [
    Speedup("no regression against stock (stock / batchrules >= 0.97)", "stock", "batchrules", 0.97),
    Speedup("not slower than the member loop (loop / batchrules >= 1)", "loop", "batchrules", 1.0),
    Speedup("ensemble_vmap not slower than the member loop (loop / ensemble_vmap >= 1)", "loop",
            "ensemble_vmap", 1.0),
    KernelsPerLinear(),
]


def ensemble_vmap_variant(func: Callable[..., Any], in_dims: Any, args: Sequence[Any]) -> Variant:
    """``batchrules.ensemble_vmap(func, in_dims)`` on ``args``, routed, timed once
    its choice is made: the first call runs the trial calls."""
    step = ensemble_vmap(func, in_dims=in_dims)
    settled: List[bool] = []

    def run() -> Any:
        if not settled:
            for _ in range(TRIAL_CALLS):
                step(*args)
            settled.append(True)
        return step(*args)
    return Variant("ensemble_vmap", run, routing=True)


def member_loop_train(models: Sequence[nn.Module], x: Tensor, y: Tensor, shared: bool
                      ) -> Callable[[], List[Tensor]]:
    """What a user writes without vmap: each member's loss and ``autograd.grad``
    in a Python loop; the gradients member by member, parameter order."""
    params = [list(m.parameters()) for m in models]

    def loop() -> List[Tensor]:
        return [g for e, m in enumerate(models)
                for g in torch.autograd.grad(mse(m(x if shared else x[e]), y[e]), params[e])]
    return loop


def scale_train_setup(models: Sequence[nn.Module], x: Tensor, y: Tensor, shared: bool,
                      limit: Callable[[Dict[str, Tensor]], Callable[[], Any]]) -> CaseSetup:
    """``train_setup`` with the input shared or per member, plus the member loop
    and stock ``vmap(chunk_size=...)`` variants."""
    params, buffers, base = stacked_ensemble(models)
    params = {k: v.detach().to(x.device) for k, v in params.items()}

    def member_loss(p: Dict[str, Tensor], b: Dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return mse(functional_call(base, (p, b), (xi,)), yi)

    in_dims = (0, 0, None if shared else 0, 0)

    def step(chunk_size: Optional[int]) -> Callable[[], Dict[str, Tensor]]:
        grads = vmap(grad(member_loss), in_dims=in_dims, chunk_size=chunk_size)
        return lambda: grads(params, buffers, x, y)

    ensemble_grads = vmap(grad(member_loss), in_dims=in_dims)

    def user_code() -> Dict[str, Tensor]:
        return ensemble_grads(params, buffers, x, y)

    @functools.lru_cache(maxsize=None)
    def per_member() -> List[List[Tensor]]:
        rows = []
        for e, m in enumerate(models):
            m64 = in_float64(m)
            xe = (x if shared else x[e]).cpu().double()
            rows.append(list(torch.autograd.grad(mse(m64(xe), y[e].cpu().double()), list(m64.parameters()))))
        return rows

    chunked = [Variant(f"stock_chunk{c}", step(c), routing=False) for c in CHUNK_SIZES]
    loop = Variant("loop", member_loop_train(models, x, y, shared),
                   reference=lambda: [g for row in per_member() for g in row])
    return CaseSetup([*stock_and_batchrules(user_code), Variant("limit", limit(params)), loop, *chunked,
                      ensemble_vmap_variant(grad(member_loss), in_dims, (params, buffers, x, y))],
                     lambda: [torch.stack(g) for g in zip(*per_member())],
                     floor=vmap_identity(in_dims, (params, buffers, x, y), returned=0))


def train_case(row: ScaleRow) -> Case:
    spec = MlpSpec((IN_FEATURES, row.hidden, row.hidden, 1), row.act)

    def build(device: torch.device) -> CaseSetup:
        models = [mlp(spec).to(device) for _ in range(row.members)]
        x = torch.randn((row.batch, IN_FEATURES) if row.shared else (row.members, row.batch, IN_FEATURES),
                        device=device)
        y = torch.randn(row.members, row.batch, 1, device=device)
        xs = x.expand(row.members, *x.shape) if row.shared else x
        return scale_train_setup(models, x, y, row.shared, lambda params: functools.partial(
            hand_written.ensemble_mse_grads, spec.layers(params), spec.act, xs, y))

    return Case(row.scenario, row.name, "large", spec.n_linears,
                f"vmap(grad(mse)) over {row.members} MLPs {spec.sizes} ({spec.act}), batch {row.batch}, "
                f"{row.inputs} input; loop: a Python loop over the members",
                build, SCALE_TARGETS)


def forward_case(row: ScaleRow) -> Case:
    spec = MlpSpec((IN_FEATURES, row.hidden, row.hidden, 1), row.act)

    def build(device: torch.device) -> CaseSetup:
        models = [mlp(spec).to(device) for _ in range(row.members)]
        params, buffers, base = stacked_ensemble(models)
        params = {k: v.detach().to(device) for k, v in params.items()}
        x = torch.randn((row.batch, IN_FEATURES) if row.shared else (row.members, row.batch, IN_FEATURES),
                        device=device)
        in_dims = (0, 0, None if row.shared else 0)

        def forward(p: Dict[str, Tensor], b: Dict[str, Tensor], xi: Tensor) -> Tensor:
            return functional_call(base, (p, b), (xi,))
        ensemble = vmap(forward, in_dims=in_dims)

        def user_code() -> Tensor:
            return ensemble(params, buffers, x)

        def loop() -> Tensor:
            with torch.no_grad():
                return torch.stack([m(x if row.shared else x[e]) for e, m in enumerate(models)])

        def chunked(c: int) -> Callable[[], Tensor]:
            fn = vmap(forward, in_dims=in_dims, chunk_size=c)
            return lambda: fn(params, buffers, x)

        def reference() -> Tensor:
            x64 = x.cpu().double()
            return torch.stack([in_float64(m)(x64 if row.shared else x64[e]) for e, m in enumerate(models)])

        layers = spec.layers(params)
        return CaseSetup([*stock_and_batchrules(user_code), Variant(
            "limit", lambda: hand_written.ensemble_forward(layers, spec.act, x, row.shared)),
            Variant("loop", loop), *(Variant(f"stock_chunk{c}", chunked(c), routing=False)
                                     for c in CHUNK_SIZES),
            ensemble_vmap_variant(forward, in_dims, (params, buffers, x))],
            reference=reference, floor=vmap_identity(in_dims, (params, buffers, x)))

    return Case(row.scenario, row.name, "large", spec.n_linears,
                f"{row.members} MLPs {spec.sizes} ({spec.act}), batch {row.batch}, "
                f"{row.inputs} input; loop: a Python loop over the members",
                build, SCALE_TARGETS)


class CriticSize(NamedTuple):
    critics: int
    batch: int
    hidden: int
    obs: int
    action: int


# REDQ/SAC's critics: Q(obs, action) = MLP(cat(obs, action)), 10 critics on one
# batch of transitions (HalfCheetah's), each regressed on one shared target.
REDQ = CriticSize(critics=10, batch=256, hidden=256, obs=17, action=6)


def critics_case(size: CriticSize = REDQ) -> Case:
    def build(device: torch.device) -> CaseSetup:
        critics = [Critic(size.obs, size.action, size.hidden).to(device) for _ in range(size.critics)]
        params, buffers, base = stacked_ensemble(critics)
        params = {k: v.detach() for k, v in params.items()}
        obs = torch.randn(size.batch, size.obs, device=device)
        action = torch.randn(size.batch, size.action, device=device)
        target = torch.randn(size.batch, 1, device=device)

        def critic_loss(p: Dict[str, Tensor], b: Dict[str, Tensor]) -> Tensor:
            return mse(functional_call(base, (p, b), (obs, action)), target)
        critic_grads = vmap(grad(critic_loss))

        def user_code() -> Dict[str, Tensor]:
            return critic_grads(params, buffers)

        theta = [list(c.parameters()) for c in critics]

        def loop() -> List[Tensor]:
            return [g for c, p in zip(critics, theta)
                    for g in torch.autograd.grad(mse(c(obs, action), target), p)]

        @functools.lru_cache(maxsize=None)
        def per_member() -> List[List[Tensor]]:
            args64 = (obs.cpu().double(), action.cpu().double())
            target64 = target.cpu().double()
            return [list(torch.autograd.grad(mse(c64(*args64), target64), list(c64.parameters())))
                    for c64 in map(in_float64, critics)]

        sa = torch.cat([obs, action], -1).expand(size.critics, size.batch, size.obs + size.action)
        layers = MlpSpec((size.obs + size.action, size.hidden, size.hidden, 1)).layers(
            {k.removeprefix("q."): v for k, v in params.items()})
        targets = target.expand(size.critics, *target.shape)
        return CaseSetup([*stock_and_batchrules(user_code), Variant(
            "limit", lambda: hand_written.ensemble_mse_grads(layers, "relu", sa, targets)),
            Variant("loop", loop, reference=lambda: [g for row in per_member() for g in row]),
            ensemble_vmap_variant(grad(critic_loss), 0, (params, buffers))],
            lambda: [torch.stack(g) for g in zip(*per_member())],
            floor=vmap_identity((0, 0), (params, buffers), returned=0))

    return Case("critic_ensemble", f"redq_{size.critics}x{size.batch}", "large", 3,
                f"vmap(grad(mse)) over {size.critics} SAC/REDQ critics Q(obs {size.obs}, action "
                f"{size.action}), hidden {size.hidden}, batch {size.batch} shared; loop: a Python loop "
                "over the critics",
                build, SCALE_TARGETS)


def cases(mode: str) -> List[Case]:
    """The rows at training sizes a mode runs (none in the smoke and headline runs)."""
    rows = [(train_case if r.train else forward_case)(r) for r in SCALE_ROWS if mode in r.modes]
    return rows + ([critics_case()] if mode in NOT_SMOKE else [])
