"""The DP-SGD example's DP fine-tuning of its small transformer under each of
``--logical-batch``, ``--ddp``, ``--fsdp`` and ``--bf16``: it trains, Opacus'
accountant reports epsilon, and the ranks match one process."""
import pytest
import torch.distributed as dist

from batchrules.examples import dp_sgd

gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                          reason="torch.distributed with gloo is not available")


@pytest.mark.parametrize("flags, expected", [
    (["--logical-batch", "48", "--physical-batch", "16"], "q 0.046875"),
    pytest.param(["--ddp", "2"], "2 DDP ranks match one process: True", marks=gloo),
    pytest.param(["--fsdp", "2"], "2 FSDP ranks match one process: True", marks=gloo),
    (["--bf16"], "loss"),
], ids=["logical_batch", "ddp", "fsdp", "bf16"])
def test_transformer_fine_tuning(flags, expected: str, capsys) -> None:
    pytest.importorskip("opacus")
    dp_sgd.main(["--model", "transformer", "--steps", "2", *flags])
    out = capsys.readouterr().out
    assert "step 0: batch" in out and "step 1: batch" in out
    assert "epsilon" in out and "RDP accountant" in out
    assert expected in out


def test_ddp_and_fsdp_need_the_same_world(capsys) -> None:
    with pytest.raises(SystemExit):
        dp_sgd.main(["--ddp", "2", "--fsdp", "3"])
    assert "--ddp and --fsdp together take the same N" in capsys.readouterr().err
