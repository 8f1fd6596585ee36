"""``DPTrainer``: transformers' ``Trainer`` fine-tuning with DP-SGD (the engine's).

The model trains through a ``PrivateModule`` and the Trainer's optimizer is
wrapped in a ``DPOptimizer`` (engine/): each physical batch's backward clips
the per-sample gradients, the optimizer step adds the noise. The loss is
DPTrainer's own: the mean over samples of each sample's loss (a causal LM's
shifted token losses, padding and ``-100`` labels ignored, averaged per
sample; a classifier's cross-entropy), so ``loss_reduction="mean"`` holds.

Note [Gradient accumulation is the logical batch]
A DP-SGD step is over a logical batch of expected size ``E =
per_device_train_batch_size * gradient_accumulation_steps``, sampled with
rate ``q = E / N``; the Trainer already steps once per accumulation cycle of
``k = gradient_accumulation_steps`` physical batches. With Poisson sampling
each logical batch (every sample independently with probability q) is cut
into k near-equal pieces, so that the Trainer's cycles are the logical
batches; a piece may be empty (it runs no forward). The Trainer must not
divide the loss by k (``loss_is_scaled_for_ga``): each piece's per-sample
gradients are those of its own mean loss. The DPOptimizer divides the noised
clipped sum by its ``expected_batch_size`` times the backwards since its last
step, and an empty piece runs none, so that size is set before each step to
E over the backwards run: the divisor is E whatever the pieces held. The
accountant steps once per optimizer step with (noise_multiplier, q).
"""
import math
import os
from typing import Any, Dict, Iterator, List, Optional, Tuple, cast

import torch
import torch.nn.functional as F
import transformers
from torch import Tensor, nn
from torch.utils.data import DataLoader, Sampler
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .engine import DPOptimizer, PrivateModule

DP_STATE_NAME = "dp_state.pt"  # a checkpoint's accountant history and noise generator state


class DPTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` that trains with DP-SGD.

    Takes the Trainer's arguments and:
        max_grad_norm: C, the per-sample clipping norm. (``TrainingArguments``'
            own ``max_grad_norm``, the clipping of the batch gradient, is
            turned off: the per-sample clipping replaces it.)
        noise_multiplier: sigma; the noise's std is sigma * C.
        target_epsilon: instead of ``noise_multiplier``: the sigma with which
            the planned steps (``max_steps``, or the epochs' steps) spend
            ``target_epsilon`` at ``target_delta``.
        target_delta: delta of the target and of the logged epsilon (keep it
            below 1 / the dataset's size).
        accountant: Opacus' accountant (``"rdp"``, ``"prv"``, ``"gdp"``).
        poisson_sampling: logical batches with Poisson sampling (See Note
            [Gradient accumulation is the logical batch]); False keeps the
            Trainer's shuffled fixed-size batches (the accountant still
            assumes Poisson sampling, as Opacus' does without it).
        noise_generator: the noise's ``torch.Generator`` (default torch's).
        validate: the engine's first-step validation (engine/validation.py).

    With ``torch_compile=True`` the private model is compiled (its clipping
    in the compiled backward: Note [The engine under torch.compile]).
    One process on one device; no fp16 loss scaling. The logs get
    ``epsilon`` (``get_epsilon()``); ``save_model`` saves the model itself;
    checkpoints hold the accountant's history and the noise generator's state
    too, so that ``train(resume_from_checkpoint=...)`` goes on with both.
    """

    # See Note [Gradient accumulation is the logical batch]
    loss_is_scaled_for_ga = True

    def __init__(self, *args: Any, max_grad_norm: float, noise_multiplier: Optional[float] = None,
                 target_epsilon: Optional[float] = None, target_delta: float = 1e-5,
                 accountant: str = "rdp", poisson_sampling: bool = True,
                 noise_generator: Optional[torch.Generator] = None, validate: bool = True,
                 **kwargs: Any) -> None:
        if (noise_multiplier is None) == (target_epsilon is None):
            raise ValueError("DPTrainer: pass exactly one of noise_multiplier and target_epsilon")
        for unsupported in ("model_init", "compute_loss_func"):
            if kwargs.get(unsupported) is not None:
                raise ValueError(f"DPTrainer: {unsupported} is not supported (the model is wrapped "
                                 "once; the loss is the mean of per-sample losses)")
        super().__init__(*args, **kwargs)
        if self.args.world_size > 1 or self.args.n_gpu > 1:
            raise ValueError("DPTrainer: one process on one device only")
        if self.args.fp16 or self.args.label_smoothing_factor:
            raise ValueError("DPTrainer: fp16 (loss scaling) and label smoothing are not supported")
        if self.train_dataset is None or not hasattr(self.train_dataset, "__len__"):
            raise ValueError("DPTrainer: needs a train_dataset with a length (map-style)")
        # the per-sample clipping replaces the Trainer's (the step writes the grads)
        self.args.max_grad_norm = 0.0
        assert self.model is not None
        self.private_module = PrivateModule(self.model, validate=validate)
        self._compiled: Optional[nn.Module] = None  # with torch_compile
        self.max_grad_norm = float(max_grad_norm)
        self.target_delta = target_delta
        self.poisson_sampling = poisson_sampling
        self.noise_generator = noise_generator
        size = len(self.train_dataset)
        self.expected_batch_size = self._train_batch_size * self.args.gradient_accumulation_steps
        if self.expected_batch_size > size:
            raise ValueError(f"DPTrainer: the logical batch ({self.expected_batch_size} samples) "
                             f"exceeds the dataset ({size})")
        self.sample_rate = self.expected_batch_size / size
        from opacus.accountants import create_accountant
        self.accountant = create_accountant(mechanism=accountant)
        if target_epsilon is not None:
            from opacus.accountants.utils import get_noise_multiplier
            noise_multiplier = get_noise_multiplier(
                target_epsilon=target_epsilon, target_delta=target_delta,
                sample_rate=self.sample_rate, steps=self.planned_steps(), accountant=accountant)
        assert noise_multiplier is not None
        self.noise_multiplier = float(noise_multiplier)
        self._pieces_run = 0  # non-empty physical batches since the last step
        self._epsilon: Tuple[Any, float] = (None, 0.0)  # (accountant's history, delta), epsilon
        self._causal = _is_causal_lm(self.model)

    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch (the logical batches)."""
        k = self.args.gradient_accumulation_steps
        if self.poisson_sampling:
            return max(1, round(1 / self.sample_rate))
        batches = math.ceil(len(self.train_dataset) / self._train_batch_size)  # type: ignore[arg-type]
        return max(1, math.ceil(batches / k))

    def planned_steps(self) -> int:
        if self.args.max_steps > 0:
            return self.args.max_steps
        return math.ceil(self.args.num_train_epochs * self.steps_per_epoch())

    def get_epsilon(self, delta: Optional[float] = None) -> float:
        """The epsilon spent so far at ``delta`` (default ``target_delta``)."""
        if not self.accountant.history:
            return 0.0
        if self.noise_multiplier == 0:
            return math.inf
        delta = delta if delta is not None else self.target_delta
        key = (repr(self.accountant.history), delta)  # the RDP bound takes a second at large q
        if self._epsilon[0] != key:
            self._epsilon = (key, float(self.accountant.get_epsilon(delta)))
        return self._epsilon[1]

    def create_optimizer(self, model: Optional[nn.Module] = None) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(model)
        if not isinstance(getattr(optimizer, "optimizer", optimizer), DPOptimizer):  # a new one
            optimizer = DPOptimizer(
                optimizer, module=self.private_module, noise_multiplier=self.noise_multiplier,
                max_grad_norm=self.max_grad_norm, expected_batch_size=self.expected_batch_size,
                generator=self.noise_generator)
            optimizer.attach_step_hook(self._account)
            self.optimizer = optimizer
        return optimizer

    def dp_optimizer(self) -> DPOptimizer:
        """The DPOptimizer (``self.optimizer`` may be accelerate's wrapper of it)."""
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        assert isinstance(optimizer, DPOptimizer)
        return optimizer

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        generator = self.noise_generator
        torch.save({"accountant": self.accountant.state_dict(),
                    "noise_generator": None if generator is None else generator.get_state()},
                   os.path.join(output_dir, DP_STATE_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or not os.path.isfile(os.path.join(checkpoint, DP_STATE_NAME)):
            return
        state = torch.load(os.path.join(checkpoint, DP_STATE_NAME), weights_only=True)
        self.accountant.load_state_dict(state["accountant"])
        if self.noise_generator is not None and state["noise_generator"] is not None:
            self.noise_generator.set_state(state["noise_generator"])

    def _account(self, optimizer: DPOptimizer) -> None:
        self.accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate)

    def _wrap_model(self, model: nn.Module, training: bool = True,
                    dataloader: Optional[DataLoader] = None) -> nn.Module:
        if not training:
            return super()._wrap_model(model, training, dataloader)
        if not self.args.torch_compile:
            return self.private_module
        if self._compiled is None:  # as the Trainer compiles a model, the engine's whole
            self._compiled = cast(nn.Module, torch.compile(
                self.private_module, backend=self.args.torch_compile_backend or "inductor",
                mode=self.args.torch_compile_mode))
        return self._compiled

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        return None  # the noised update is formed in the step, after the Trainer would measure it

    def get_train_dataloader(self) -> DataLoader:
        if not self.poisson_sampling:
            return super().get_train_dataloader()
        from .engine.data_loader import CollateWithEmpty, PoissonBatchSampler
        dataset: Any = self.train_dataset
        if transformers.utils.is_datasets_available():
            import datasets
            if isinstance(dataset, datasets.Dataset):
                dataset = self._remove_unused_columns(dataset, description="Training")
        collate = self._get_collator_with_removed_columns(self.data_collator, description="Training")
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        logical = PoissonBatchSampler(num_samples=len(dataset), sample_rate=self.sample_rate,
                                      steps=self.steps_per_epoch(),
                                      generator=torch.Generator().manual_seed(seed))
        pieces = LogicalBatchPieces(logical, self.args.gradient_accumulation_steps)
        return DataLoader(dataset, batch_sampler=pieces,
                          collate_fn=CollateWithEmpty(collate, dataset),
                          num_workers=self.args.dataloader_num_workers,
                          pin_memory=self.args.dataloader_pin_memory)

    def training_step(self, model: nn.Module, inputs: Dict[str, Any],
                      num_items_in_batch: Any = None) -> Tensor:
        model.train()
        inputs = self._prepare_inputs(inputs)
        if _batch_size(inputs) > 0:
            # the model is not accelerate's prepared one: its autocast (bf16) is entered here
            with self.compute_loss_context_manager(), self.accelerator.autocast():
                loss = self.compute_loss(model, inputs)
            loss.backward()
            self._pieces_run += 1
            loss = loss.detach()
        else:
            loss = torch.zeros((), device=self.args.device)
        if self.accelerator.sync_gradients:  # the cycle's last piece: the step follows
            # See Note [Gradient accumulation is the logical batch]
            self.dp_optimizer().expected_batch_size = \
                self.expected_batch_size / max(self._pieces_run, 1)  # type: ignore[assignment]
            self._pieces_run = 0
        return loss / self.current_gradient_accumulation_steps  # for the logged loss

    def compute_loss(self, model: nn.Module, inputs: Dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        inputs = dict(inputs)
        labels = inputs.pop("labels", None)
        if labels is None:
            raise ValueError("DPTrainer: the batches need 'labels'")
        outputs = model(**inputs)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        loss = per_sample_losses(logits, labels, inputs.get("attention_mask"),
                                 shift=self._causal).mean()
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: Dict[str, float], start_time: Optional[float] = None) -> None:
        if self.accountant.history:
            logs["epsilon"] = self.get_epsilon()
        super().log(logs, start_time)


def per_sample_losses(logits: Tensor, labels: Tensor, attention_mask: Optional[Tensor] = None, *,
                      shift: bool = False) -> Tensor:
    """Each sample's loss, ``[B]``: for token labels ``[B, T]`` the mean of
    its token losses (labels ``-100`` and positions the mask zeroes ignored;
    ``shift``: token t predicts label t + 1, as a causal LM); for labels
    ``[B]`` cross-entropy, or the squared error of a single output (regression)."""
    if labels.dim() >= 2 and logits.dim() == labels.dim() + 1:
        if attention_mask is not None:
            labels = labels.masked_fill(attention_mask == 0, -100)
        if shift:
            logits, labels = logits[:, :-1], labels[:, 1:]
        tokens = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                 reduction="none").view(labels.shape)
        valid = (labels != -100).to(tokens.dtype)
        return (tokens * valid).flatten(1).sum(1) / valid.flatten(1).sum(1).clamp(min=1)
    if logits.shape[-1] == 1 and labels.is_floating_point():
        return (logits.view(-1) - labels.view(-1).to(logits.dtype)) ** 2
    return F.cross_entropy(logits, labels, reduction="none")


class LogicalBatchPieces(Sampler[List[int]]):
    """Each batch of ``logical`` cut into ``k`` pieces of near-equal sizes (some
    empty when it holds fewer than k samples)."""

    def __init__(self, logical: Sampler[List[int]], k: int) -> None:
        self.logical, self.k = logical, k

    def __iter__(self) -> Iterator[List[int]]:
        for batch in self.logical:
            batch = list(batch)
            bounds = [len(batch) * j // self.k for j in range(self.k + 1)]
            for j in range(self.k):
                yield batch[bounds[j]:bounds[j + 1]]

    def __len__(self) -> int:
        return len(self.logical) * self.k  # type: ignore[arg-type]


def _batch_size(inputs: Dict[str, Any]) -> int:
    for value in inputs.values():
        if isinstance(value, Tensor) and value.dim() > 0:
            return value.shape[0]
    return 0


def _is_causal_lm(model: nn.Module) -> bool:
    base = getattr(model, "get_base_model", None)  # a peft model's
    inner = base() if callable(base) else model
    return type(inner).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
