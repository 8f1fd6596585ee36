"""DP fine-tuning of a causal LM with transformers' Trainer: ``batchrules.dp.hf.DPTrainer``.

A tiny GPT-2 (random weights from a config: nothing is downloaded) learns a
synthetic language, in memory, of right-padded sequences with the standard
2-D ``attention_mask``. ``DPTrainer`` is the Trainer with three more
arguments: the per-sample clipping norm C (``max_grad_norm``), and the noise
multiplier, or the target epsilon at ``target_delta`` for the planned steps.
``gradient_accumulation_steps`` is the logical batch (Poisson sampled, cut
into that many physical batches); the logs get the epsilon spent so far.

    python -m batchrules.examples.dp_finetune_hf [--steps 8] [--target-epsilon 8]
"""
import argparse
import tempfile
from typing import Dict, Optional

import torch
from torch import Tensor
from torch.utils.data import Dataset

VOCAB, TOKENS = 32, 12


class CountingSequences(Dataset):
    """Sequences that count up from a random start (mod VOCAB), right-padded
    to TOKENS; the labels are the ids (the model shifts them)."""

    def __init__(self, size: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, VOCAB, (size, 1), generator=g)
        self.ids = (starts + torch.arange(TOKENS)) % VOCAB
        lengths = torch.randint(4, TOKENS + 1, (size, 1), generator=g)
        self.mask = (torch.arange(TOKENS) < lengths).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Dict[str, Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.ids[i]}


def main(steps: int = 8, target_epsilon: Optional[float] = None) -> None:
    """Fine-tunes for ``steps`` logical batches and prints the losses and epsilon."""
    import transformers

    from batchrules.dp.hf import DPTrainer

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=TOKENS, n_embd=32, n_layer=2,
                                     n_head=2, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=16, gradient_accumulation_steps=2,
            max_steps=steps, learning_rate=2e-3, logging_steps=max(1, steps // 4),
            report_to=[], save_strategy="no", disable_tqdm=True, use_cpu=True)
        trainer = DPTrainer(model=model, args=args, train_dataset=CountingSequences(512),
                            max_grad_norm=1.0, target_epsilon=target_epsilon,
                            noise_multiplier=None if target_epsilon else 0.8, target_delta=1e-5)
        trainer.remove_callback(transformers.PrinterCallback)  # the lines below say it
        trainer.train()
    for entry in trainer.state.log_history:
        if "loss" in entry:
            print(f"step {entry['step']}: loss {entry['loss']:.3f}, epsilon {entry['epsilon']:.2f}")
    print(f"noise multiplier {trainer.noise_multiplier:.3f}, sample rate {trainer.sample_rate:.4f}: "
          f"epsilon {trainer.get_epsilon():.2f} at delta 1e-05 after {trainer.state.global_step} steps")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--target-epsilon", type=float, default=None)
    cli = parser.parse_args()
    main(cli.steps, cli.target_epsilon)
