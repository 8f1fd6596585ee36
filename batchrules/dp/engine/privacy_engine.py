"""``PrivacyEngine``: DP-SGD in the user's own training loop, with Opacus' names.

``make_private`` returns the three objects the loop already uses, made
private: the model (``PrivateModule``: one forward over the physical batch,
the clipped sums formed after ``loss.backward()``), the optimizer
(``DPOptimizer``: clipping, noise, then the user's optimizer's step) and the
data loader (``DPDataLoader``: Poisson sampling). The loop itself does not
change::

    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader,
        noise_multiplier=1.0, max_grad_norm=1.0)
    for x, y in loader:
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
    engine.get_epsilon(delta=1e-5)

The accountant is one of Opacus' (``"prv"``, ``"rdp"``, ``"gdp"``): every
optimizer step that is not skipped records ``(noise_multiplier, q)`` in its
history. Opacus is imported when an engine is made, not with batchrules.

Note [Bit-identical resume]
A run's randomness is the data loader's generator (Poisson sampling and the
loader's worker seeds) and the optimizer's noise generator; ``make_private``
makes both private ``torch.Generator`` objects (seeded from torch's default
generator unless given), so a checkpoint can hold their states next to the
model's, the optimizer's and the accountant's. Loading it into objects made
the same way continues the run exactly as if it had not stopped, when it was
saved at the end of an epoch: each epoch's iterator draws the workers' seed
from the loader's generator, and the optimizer's running clipped sums (a
logical batch in progress) are not saved. Anything else random in the loop
(dropout on torch's default generator) is the caller's to save. Secure mode
has no generator state: its runs cannot be replayed.
"""
import os
import warnings
from typing import IO, Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from .data_loader import DPDataLoader, PoissonBatchSampler
from .module import PrivateModule
from .optimizer import DPOptimizer

Path = Union[str, os.PathLike, IO[bytes]]


class PrivacyEngine:
    """DP-SGD's set-up and privacy accounting (Opacus' ``PrivacyEngine``).

    Args:
        accountant: ``"prv"`` (default), ``"rdp"`` or ``"gdp"``: Opacus'
            accountant of that mechanism, as ``self.accountant``.
        secure_mode: noise and Poisson sampling from ``os.urandom`` with the
            floating-point mitigation (Note [Secure mode] in noise.py, with
            its caveats); no seed or generator may then be given.
    """

    def __init__(self, *, accountant: str = "prv", secure_mode: bool = False) -> None:
        from opacus.accountants import create_accountant
        self.accountant = create_accountant(mechanism=accountant)
        self.secure_mode = secure_mode
        self.dataset: Any = None  # warns when another dataset is made private
        self.data_loader: Optional[DataLoader] = None  # the last make_private's, for checkpoints

    def make_private(self, *, module: nn.Module, optimizer: torch.optim.Optimizer,
                     data_loader: DataLoader, noise_multiplier: float, max_grad_norm: float,
                     poisson_sampling: bool = True, loss_reduction: str = "mean",
                     noise_generator: Optional[torch.Generator] = None,
                     validate: bool = True, criterion: Optional[nn.Module] = None,
                     batch_first: bool = True, clipping: str = "flat",
                     grad_sample_mode: str = "hooks") -> Tuple[Any, ...]:
        """``(module, optimizer, data_loader)`` made private (Opacus' semantics);
        ``(module, optimizer, criterion, data_loader)`` with ``grad_sample_mode="ghost"``,
        as Opacus returns them.

        Args:
            module: the model; sample i is row i of dim 0 of every input. A
                ``DistributedDataParallel`` is unwrapped and its process
                group reduces the clipped sums; a model sharded by FSDP2's
                ``fully_shard`` is reduce-scattered onto (Note [The engine on
                an FSDP2 model] in fsdp.py). Either way each rank samples its
                share of the data.
            optimizer: any torch optimizer over (a subset of) the model's
                parameters; frozen parameters stay out of the step.
            data_loader: replaced by a ``DPDataLoader`` with q = 1 /
                ``len(data_loader)`` (``poisson_sampling=False``: kept as is;
                the accounting then only approximates its sampling).
            noise_multiplier: sigma; the noise std is ``sigma * max_grad_norm``.
            max_grad_norm: C, the per-sample clipping bound.
            loss_reduction: ``"mean"`` (the loss is averaged over the batch:
                the update is ``(sum of clipped + noise) / int(q * N)``) or
                ``"sum"`` (no division).
            noise_generator: the noise's ``torch.Generator`` (default: a new
                one on the first trainable parameter's device, seeded from
                torch's default generator). Refused in secure mode.
            validate: compare the first step's per-sample norms with the
                samples run one at a time, before any update.
            criterion, batch_first, clipping, grad_sample_mode: Opacus'
                arguments, taken so that an Opacus script runs unchanged:
                every ``grad_sample_mode`` runs this engine (its per-sample
                norms are exact, as Opacus' ghost clipping's), the criterion is
                returned as given (any criterion works with the plain
                ``loss.backward()``), and only ``batch_first=True`` and
                ``clipping="flat"`` exist here.
        """
        _check_opacus_options(batch_first, clipping, grad_sample_mode)
        if self.secure_mode and noise_generator is not None:
            raise ValueError("PrivacyEngine: secure mode draws noise from os.urandom; "
                             "noise_generator must be None")
        process_group = None
        if isinstance(module, DistributedDataParallel):
            process_group, module = module.process_group, module.module
        private = PrivateModule(module, loss_reduction=loss_reduction, validate=validate)
        distributed = process_group is not None or bool(private.fsdp_modules)
        data_loader = self._prepare_data_loader(data_loader, poisson_sampling, distributed=distributed)
        sample_rate = 1 / len(data_loader)
        expected_batch_size = int(len(data_loader.dataset) * sample_rate)  # type: ignore[arg-type]
        generator = None if self.secure_mode else noise_generator or _new_generator(private)
        dp_optimizer = DPOptimizer(
            optimizer, module=private, noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm, expected_batch_size=expected_batch_size,
            loss_reduction=loss_reduction, generator=generator, secure_mode=self.secure_mode,
            process_group=process_group)
        dp_optimizer.attach_step_hook(self._accountant_hook(sample_rate))
        self.data_loader = data_loader
        if grad_sample_mode == "ghost":
            return private, dp_optimizer, criterion, data_loader
        return private, dp_optimizer, data_loader

    def make_private_with_epsilon(self, *, module: nn.Module, optimizer: torch.optim.Optimizer,
                                  data_loader: DataLoader, target_epsilon: float,
                                  target_delta: float, epochs: int, max_grad_norm: float,
                                  poisson_sampling: bool = True, loss_reduction: str = "mean",
                                  noise_generator: Optional[torch.Generator] = None,
                                  validate: bool = True, criterion: Optional[nn.Module] = None,
                                  batch_first: bool = True, clipping: str = "flat",
                                  grad_sample_mode: str = "hooks",
                                  **kwargs: Any) -> Tuple[Any, ...]:
        """``make_private`` with the noise multiplier that spends
        ``(target_epsilon, target_delta)`` in ``epochs`` epochs of
        ``len(data_loader)`` steps (Opacus' ``get_noise_multiplier``, with
        this engine's accountant; ``kwargs`` go to it, e.g.
        ``epsilon_tolerance``, default 0.01)."""
        from opacus.accountants.utils import get_noise_multiplier
        if len(self.accountant) > 0:
            warnings.warn("PrivacyEngine.make_private_with_epsilon: the accountant has already "
                          "recorded steps; the noise multiplier is computed as if it had not, "
                          "so the total epsilon will exceed the target")
        sigma = get_noise_multiplier(target_epsilon=target_epsilon, target_delta=target_delta,
                                     sample_rate=1 / len(data_loader), epochs=epochs,
                                     accountant=self.accountant.mechanism(), **kwargs)
        return self.make_private(module=module, optimizer=optimizer, data_loader=data_loader,
                                 noise_multiplier=sigma, max_grad_norm=max_grad_norm,
                                 poisson_sampling=poisson_sampling, loss_reduction=loss_reduction,
                                 noise_generator=noise_generator, validate=validate,
                                 criterion=criterion, batch_first=batch_first, clipping=clipping,
                                 grad_sample_mode=grad_sample_mode)

    def get_epsilon(self, delta: float) -> float:
        """The epsilon spent so far at ``delta``, by the accountant."""
        return float(self.accountant.get_epsilon(delta=delta))

    def save_checkpoint(self, *, path: Path, module: nn.Module,
                        optimizer: Optional[DPOptimizer] = None,
                        data_loader: Optional[DataLoader] = None,
                        checkpoint_dict: Optional[Dict[str, Any]] = None,
                        module_state_dict_kwargs: Optional[Dict[str, Any]] = None,
                        torch_save_kwargs: Optional[Dict[str, Any]] = None) -> None:
        """Saves the module's, the optimizer's and the accountant's state
        dicts (Opacus' keys) and the noise's and the data loader's generator
        states (``data_loader`` defaults to the last one ``make_private``
        returned): See Note [Bit-identical resume]. ``checkpoint_dict``:
        further entries to save along."""
        checkpoint = dict(checkpoint_dict or {})
        checkpoint["module_state_dict"] = module.state_dict(**(module_state_dict_kwargs or {}))
        checkpoint["privacy_accountant_state_dict"] = self.accountant.state_dict()
        if optimizer is not None:
            checkpoint["optimizer_state_dict"] = optimizer.state_dict()
            if optimizer.generator is not None:
                checkpoint["noise_generator_state"] = optimizer.generator.get_state()
        loader = data_loader if data_loader is not None else self.data_loader
        if loader is not None:
            checkpoint["data_loader_generator_states"] = [
                g.get_state() for g in _loader_generators(loader)]
        torch.save(checkpoint, path, **(torch_save_kwargs or {}))

    def load_checkpoint(self, *, path: Path, module: nn.Module,
                        optimizer: Optional[DPOptimizer] = None,
                        data_loader: Optional[DataLoader] = None,
                        module_load_dict_kwargs: Optional[Dict[str, Any]] = None,
                        torch_load_kwargs: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """Restores what ``save_checkpoint`` saved into ``module``,
        ``optimizer``, this engine's accountant and ``data_loader`` (default:
        the last one ``make_private`` returned); returns the checkpoint. A
        checkpoint without generator states (Opacus') leaves the generators
        as they are; one with states for generators these objects lack
        (secure mode) is refused."""
        checkpoint: Dict[str, Any] = torch.load(path, **{"weights_only": True,
                                                         **(torch_load_kwargs or {})})
        module.load_state_dict(checkpoint["module_state_dict"], **(module_load_dict_kwargs or {}))
        self.accountant.load_state_dict(checkpoint["privacy_accountant_state_dict"])
        if optimizer is not None and "optimizer_state_dict" in checkpoint:
            optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
        if optimizer is not None and "noise_generator_state" in checkpoint:
            _set_states([optimizer.generator] if optimizer.generator is not None else [],
                        [checkpoint["noise_generator_state"]], "the noise")
        loader = data_loader if data_loader is not None else self.data_loader
        if loader is not None and "data_loader_generator_states" in checkpoint:
            _set_states(_loader_generators(loader), checkpoint["data_loader_generator_states"],
                        "the data loader")
        return checkpoint

    def _prepare_data_loader(self, data_loader: DataLoader, poisson_sampling: bool,
                             distributed: bool) -> DataLoader:
        if self.dataset is None:
            self.dataset = data_loader.dataset
        elif self.dataset is not data_loader.dataset:
            warnings.warn("PrivacyEngine: make_private got another dataset than before; the "
                          "accountant adds up the privacy loss of one dataset: use a new "
                          "PrivacyEngine for another")
        if poisson_sampling:
            return DPDataLoader.from_data_loader(data_loader, secure=self.secure_mode,
                                                 distributed=distributed)
        if self.secure_mode:
            warnings.warn("PrivacyEngine: secure mode with poisson_sampling=False: the data "
                          "loader's own sampling does not draw from the secure source")
        return data_loader

    def _accountant_hook(self, sample_rate: float) -> Callable[[DPOptimizer], None]:
        def step(optimizer: DPOptimizer) -> None:
            self.accountant.step(noise_multiplier=optimizer.noise_multiplier,
                                 sample_rate=sample_rate)
        return step


_GRAD_SAMPLE_MODES = ("hooks", "ew", "functorch", "ghost")


def _check_opacus_options(batch_first: bool, clipping: str, grad_sample_mode: str) -> None:
    if not batch_first:
        raise ValueError("PrivacyEngine: batch_first=False is not supported: sample i of a batch "
                         "must be row i of dim 0 of the model's inputs (transpose inside the "
                         "model; nn.LSTM(batch_first=False) inside a model is fine)")
    if clipping != "flat":
        raise ValueError(f"PrivacyEngine: clipping={clipping!r} is not supported; only 'flat' "
                         "(one norm over all parameters)")
    if grad_sample_mode not in _GRAD_SAMPLE_MODES:
        raise ValueError(f"PrivacyEngine: unknown grad_sample_mode {grad_sample_mode!r}; Opacus' "
                         f"are {_GRAD_SAMPLE_MODES}")


def _new_generator(module: PrivateModule) -> torch.Generator:
    """A generator on the device of the first trainable parameter, seeded from
    torch's default generator."""
    params = module.trainable_parameters()
    generator = torch.Generator(device=params[0][1].device if params else "cpu")
    generator.manual_seed(int(torch.randint(0, 2 ** 62, (), dtype=torch.int64)))
    return generator


def _loader_generators(loader: DataLoader) -> List[torch.Generator]:
    """The distinct generators a loader's batches come from: its own (worker
    seeds; Poisson sampling for a ``DPDataLoader``), its batch sampler's and
    its sampler's (a ``RandomSampler`` given one)."""
    found: List[torch.Generator] = []
    sampler = loader.batch_sampler
    for candidate in (loader.generator,
                      sampler.generator if isinstance(sampler, PoissonBatchSampler) else None,
                      getattr(loader.sampler, "generator", None)):
        if isinstance(candidate, torch.Generator) and all(candidate is not g for g in found):
            found.append(candidate)
    return found


def _set_states(generators: List[torch.Generator], states: List[torch.Tensor], what: str) -> None:
    if len(generators) != len(states):
        raise ValueError(f"PrivacyEngine.load_checkpoint: the checkpoint holds {len(states)} "
                         f"generator state(s) for {what}, which has {len(generators)}")
    for generator, state in zip(generators, states):
        generator.set_state(state)
