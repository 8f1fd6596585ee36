"""``batchrules.dp.hf.DPTrainer``: transformers' Trainer with the DP engine, on
tiny GPT-2, BERT and a peft LoRA built from configs (nothing downloaded),
datasets in memory with right-padded 2-D attention masks. It trains and logs
epsilon (Opacus' accountant's for the same sigma, q and steps); with noise 0
one step of SGD(lr=1) over a logical batch of two accumulated pieces equals
the engine's step on that batch and ``-(1/E) sum_i clip_C(g_i)`` (E the
expected logical batch size) against a float64 per-sample loop; a LoRA moves
only its adapters; ``save_model`` writes the model itself."""
import copy
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.nn.functional as F
from test_dp_engine_models import (
    VOCAB,
    Batch,
    T,
    assert_moved_by,
    engine_step,
    gpt2,
    loop_clipped_sum,
    padding_mask,
    token_loss,
)
from torch import Tensor, nn

pytestmark = pytest.mark.requires("transformers", "peft", "opacus")

N, PHYSICAL, PIECES = 16, 4, 2  # samples, per-device batch, accumulation steps
LOGICAL = PHYSICAL * PIECES  # E


class TokenDataset(torch.utils.data.Dataset):
    """Token ids with right padding; labels the ids (a causal LM) or a class."""

    def __init__(self, classes: int = 0) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (N, T), generator=g)
        self.mask = torch.cat([padding_mask(6), padding_mask(6), padding_mask(4)])
        self.labels = torch.randint(0, classes, (N,), generator=g) if classes else self.ids

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> Dict[str, Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}

    def batch(self, index: Any = slice(None)) -> Batch:
        return (), {"input_ids": self.ids[index], "attention_mask": self.mask[index]}, \
            self.labels[index]


def bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification
    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=32, max_position_embeddings=16,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)
    return BertForSequenceClassification(config).double()


def lora() -> nn.Module:
    from peft import LoraConfig, get_peft_model
    return get_peft_model(gpt2(), LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True,
                                             init_lora_weights=False))


def class_loss(out: Any, y: Tensor, kwargs: Dict[str, Any]) -> Tensor:
    return F.cross_entropy(out.logits, y, reduction="none")


# model, its dataset's classes (0: a causal LM), the per-sample loss
MODELS = {"gpt2": (gpt2, 0, token_loss), "bert": (bert, 3, class_loss),
          "lora": (lora, 0, token_loss)}


def recording_trainer(tmp_path: Any, model: nn.Module, dataset: TokenDataset, steps: int,
                      physical: int = PHYSICAL, pieces: int = PIECES, seed: int = 42,
                      save_steps: int = 0, bf16: bool = False, compile_backend: Optional[str] = None,
                      **dp: Any) -> Any:
    """A DPTrainer (SGD, lr 1, constant) that keeps the physical batches it trains on."""
    import transformers

    from batchrules.dp.hf import DPTrainer

    class Recording(DPTrainer):
        pieces: List[Dict[str, Tensor]] = []

        def training_step(self, model: nn.Module, inputs: Dict[str, Any], *args: Any) -> Tensor:
            self.pieces.append(dict(inputs))
            return super().training_step(model, inputs, *args)

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=physical,
        gradient_accumulation_steps=pieces, max_steps=steps, learning_rate=1.0, optim="sgd",
        weight_decay=0.0, lr_scheduler_type="constant", logging_steps=1, report_to=[],
        use_cpu=True, save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        disable_tqdm=True, seed=seed, bf16=bf16, torch_compile=compile_backend is not None,
        torch_compile_backend=compile_backend)
    trainer = Recording(model=model, args=args, train_dataset=dataset, **dp)
    trainer.pieces = []
    return trainer


@pytest.mark.parametrize("name", list(MODELS))
def test_trains_and_logs_epsilon(name: str, tmp_path: Any) -> None:
    from opacus.accountants import RDPAccountant
    make, classes, _ = MODELS[name]
    model = make()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = recording_trainer(tmp_path, model, TokenDataset(classes), 3, max_grad_norm=1.0,
                                noise_multiplier=1.0)
    logged = []
    for _ in range(2):  # train() again: a new TrainerState, the same DPOptimizer and accountant
        trainer.train()
        logged += [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [e["step"] for e in logged] == [1, 2, 3] * 2
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in logged)
    accountant = RDPAccountant()
    for e in logged:  # one accountant over both runs
        accountant.step(noise_multiplier=1.0, sample_rate=LOGICAL / N)
        assert e["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)
    assert len(trainer.pieces) == 6 * PIECES
    assert torch.isfinite(torch.tensor(trainer.evaluate(TokenDataset(classes))["eval_loss"]))
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) != p.requires_grad, n  # the noise moves all, and only, the trainable


@pytest.mark.parametrize("poisson", [True, False], ids=["poisson", "shuffled"])
@pytest.mark.parametrize("name", list(MODELS))
def test_zero_noise_step_is_the_engines(name: str, poisson: bool, tmp_path: Any) -> None:
    check_zero_noise_step(name, poisson, tmp_path)


def check_zero_noise_step(name: str, poisson: bool, tmp_path: Any,
                          compile_backend: Optional[str] = None) -> None:
    """One zero-noise step moves the parameters as the engine's step on the
    logical batch the Trainer drew, and as the per-sample loop."""
    make, classes, loss = MODELS[name]
    dataset = TokenDataset(classes)
    model = make()
    _, _, c = loop_clipped_sum(model, dataset.batch(), loss)  # C: the dataset's median norm
    initial = copy.deepcopy(model)
    trainer = recording_trainer(tmp_path, model, dataset, 1, max_grad_norm=c, noise_multiplier=0.0,
                                poisson_sampling=poisson, compile_backend=compile_backend)
    trainer.train()
    assert len(trainer.pieces) == PIECES
    if not poisson:
        assert [len(p["input_ids"]) for p in trainer.pieces] == [PHYSICAL] * PIECES
    seen = torch.cat([p["input_ids"] for p in trainer.pieces])
    index = torch.tensor([next(i for i in range(N) if torch.equal(dataset.ids[i], row))
                          for row in seen], dtype=torch.long)
    logical = dataset.batch(index)
    moved = {n: p.detach() - initial.state_dict()[n] for n, p in model.named_parameters()}
    want, norms, _ = loop_clipped_sum(copy.deepcopy(initial), logical, loss, c)
    assert (norms > c).any() and (norms < c).any()  # some clipped, some not
    assert_moved_by(moved, {n: -w / LOGICAL for n, w in want.items()})
    engine = engine_step(initial, [logical], loss, c, LOGICAL)
    for n, m in moved.items():
        torch.testing.assert_close(m, engine[n], rtol=1e-12, atol=1e-15)


@pytest.mark.usefixtures("fresh_dynamo")
def test_torch_compile_compiles_the_engine(tmp_path: Any) -> None:
    """``torch_compile=True``: the private model is compiled, and the step is
    still the engine's."""
    from torch._dynamo.utils import counters
    counters.clear()
    check_zero_noise_step("gpt2", True, tmp_path, compile_backend="aot_eager")
    assert counters["stats"]["unique_graphs"] > 0


def test_empty_pieces_keep_the_divisor(tmp_path: Any) -> None:
    """A Poisson logical batch of fewer samples than pieces: the empty pieces
    run no backward, and the step still divides by E."""
    dataset, model = TokenDataset(), gpt2()
    _, _, c = loop_clipped_sum(model, dataset.batch(), token_loss)
    initial = copy.deepcopy(model)
    trainer = recording_trainer(tmp_path, model, dataset, 1, physical=1, pieces=LOGICAL,
                                seed=2, max_grad_norm=c, noise_multiplier=0.0)  # 6 samples
    trainer.train()
    sizes = [len(p["input_ids"]) for p in trainer.pieces]
    assert len(sizes) == LOGICAL and 0 in sizes and sum(sizes) > 0
    seen = torch.cat([p["input_ids"] for p in trainer.pieces])
    index = [next(i for i in range(N) if torch.equal(dataset.ids[i], row)) for row in seen]
    want, _, _ = loop_clipped_sum(initial, dataset.batch(torch.tensor(index)), token_loss, c)
    moved = {n: p.detach() - initial.state_dict()[n] for n, p in model.named_parameters()}
    assert_moved_by(moved, {n: -w / LOGICAL for n, w in want.items()})


def test_target_epsilon_is_reached(tmp_path: Any) -> None:
    trainer = recording_trainer(tmp_path, gpt2(), TokenDataset(), 4, physical=2, max_grad_norm=1.0,
                                target_epsilon=3.0, target_delta=1e-5)
    assert trainer.sample_rate == 4 / N and trainer.noise_multiplier > 0
    trainer.train()
    assert trainer.get_epsilon() == pytest.approx(3.0, rel=0.01)


def test_save_model_writes_the_model(tmp_path: Any) -> None:
    from transformers import GPT2LMHeadModel
    model = gpt2()
    trainer = recording_trainer(tmp_path, model, TokenDataset(), 1, max_grad_norm=1.0,
                                noise_multiplier=1.0)
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    loaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / "saved"), dtype=torch.float64)
    for (n, p), q in zip(model.named_parameters(), loaded.parameters()):
        assert torch.equal(p, q), n


def test_resume_from_checkpoint_goes_on(tmp_path: Any) -> None:
    """Resumed after its first step, a run with noise ends as the uninterrupted
    one: the same parameters and epsilon (the accountant's history and the
    sampling restored)."""
    model = gpt2()
    initial = copy.deepcopy(model)
    whole = recording_trainer(tmp_path / "whole", model, TokenDataset(), 2, save_steps=1,
                              max_grad_norm=1.0, noise_multiplier=1.0)
    whole.train()
    resumed = recording_trainer(tmp_path / "resumed", initial, TokenDataset(), 2,
                                max_grad_norm=1.0, noise_multiplier=1.0)
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-1"))
    assert resumed.get_epsilon() == whole.get_epsilon() and len(resumed.pieces) == PIECES
    for (n, p), q in zip(model.named_parameters(), initial.parameters()):
        assert torch.equal(p, q), n


def test_bf16_runs_under_autocast(tmp_path: Any) -> None:
    model = gpt2().float()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = recording_trainer(tmp_path, model, TokenDataset(), 1, bf16=True, max_grad_norm=1.0,
                                noise_multiplier=1.0)
    logits = []
    model.lm_head.register_forward_hook(lambda m, i, out: logits.append(out.dtype))
    trainer.train()
    # the pieces' forwards (the first-step validation's follow, in float32)
    assert logits[:PIECES] == [torch.bfloat16] * PIECES
    assert all(p.dtype == torch.float32 and not torch.equal(p, before[n])
               for n, p in model.named_parameters())


def test_refuses_ambiguous_noise(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="exactly one of noise_multiplier and target_epsilon"):
        recording_trainer(tmp_path, gpt2(), TokenDataset(), 1, max_grad_norm=1.0)
