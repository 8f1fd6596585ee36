"""DP fine-tuning with transformers' Trainer (``DPTrainer``): the example runs as
an imported function and as ``python -m batchrules.examples.dp_finetune_hf``,
prints the losses and the epsilon its logs hold, and leaves the routing switch
as it found it."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import batchrules

PACKAGE_PARENT = Path(batchrules.__file__).resolve().parents[1]
EXPECTED = ["step 2: loss", "epsilon", "noise multiplier 0.800, sample rate 0.0625"]

pytestmark = pytest.mark.requires("transformers", "opacus")


@pytest.mark.parametrize("routing_before", [False, True])
def test_example_main(routing_before: bool, capsys: pytest.CaptureFixture,
                      no_vmap_fallback: None) -> None:
    from batchrules.examples import dp_finetune_hf
    with batchrules.enabled(routing_before):
        dp_finetune_hf.main(steps=2)
        assert batchrules.is_enabled() == routing_before
    printed = capsys.readouterr().out
    for line in EXPECTED:
        assert line in printed
    assert "after 2 steps" in printed


# slow: a fresh interpreter that imports torch and transformers; the only check
# of the example's __main__ entry point and its command line.
@pytest.mark.slow
def test_example_runs_as_module() -> None:
    path = os.pathsep.join([str(PACKAGE_PARENT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    env.pop("BATCHRULES_ENABLE", None)
    result = subprocess.run([sys.executable, "-m", "batchrules.examples.dp_finetune_hf",
                             "--steps", "2", "--target-epsilon", "4"], env=env,
                            cwd=PACKAGE_PARENT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    # the noise multiplier spends the target within 1% in the planned steps
    assert re.search(r"epsilon (3\.9[6-9]|4\.00) at delta 1e-05 after 2 steps", result.stdout), \
        result.stdout
