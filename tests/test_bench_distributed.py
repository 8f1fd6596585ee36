"""The distributed DP bench (``python -m batchrules.bench.distributed``) runs
on 2 gloo ranks and prints its table with the targets."""
import pytest

from batchrules.bench import distributed


@pytest.mark.slow  # spawns 2 processes that import torch and run DDP and FSDP2: ~8 s on 2 cores
def test_distributed_bench_prints_table(capsys):
    distributed.main(["--smoke", "--timeout", "120"])
    out = capsys.readouterr().out
    assert "TinyTransformer(d=32" in out
    for wrapper in ("ddp", "fsdp2"):
        rows = [line for line in out.splitlines() if line.startswith(wrapper)]
        assert len(rows) == distributed.WORLD
        assert all("time <= 1.3x" in row for row in rows)
    assert all("memory <= 1.3x" in line for line in out.splitlines() if line.startswith("fsdp2"))


def test_table_marks_targets():
    step = {"median_s": 0.01, "peak_bytes": 2 ** 20}
    slow = {"median_s": 0.02, "peak_bytes": 2 * 2 ** 20}
    rank = {"ddp": {"nonprivate": step, "dp": step}, "fsdp2": {"nonprivate": step, "dp": slow}}
    text = distributed.table([rank, rank], distributed.SMOKE)
    ddp = [line for line in text.splitlines() if line.startswith("ddp")]
    fsdp = [line for line in text.splitlines() if line.startswith("fsdp2")]
    assert all("time <= 1.3x met" in line and "memory" not in line for line in ddp)
    assert all("time <= 1.3x MISSED" in line and "memory <= 1.3x MISSED" in line for line in fsdp)
