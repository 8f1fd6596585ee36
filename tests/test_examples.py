"""The examples run as ``python -m batchrules.examples.<name>`` and as imported
functions, print what they promise, and leave the routing switch as they found it."""
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import batchrules

# Where the imported batchrules lives (checkout or site-packages): subprocesses
# run there so that they import the same build.
PACKAGE_PARENT = Path(batchrules.__file__).resolve().parents[1]

# module -> lines its output must contain
EXPECTED_OUTPUT = {
    "hypernetwork": ["logits (8, 3) match loop: True", "sample 0 matches autograd: True"],
    "ensembling": ["per-model minibatches: (4, 16, 3)", "shared minibatch:      (4, 16, 3)",
                   "step 4: losses"],
    "per_sample_grads": ["'4.weight': (8, 16, 36)", "DP-SGD step 2: loss"],
    "recurrent_ensemble": ["ensemble of 5 GRU dynamics models", "match the per-member loop: True",
                           "step 4: losses"],
    "lstm_per_sample_grads": ["'lstm.weight_hh_l0': (8, 64, 16)",
                              "per-sample grads match the float64 loop: True"],
    "inspect_routing": ["routing on : {'batchrules::linear': 1", "routing off: {}",
                        "eager, routing on: {}"],
}


@pytest.mark.parametrize("name", list(EXPECTED_OUTPUT))
@pytest.mark.parametrize("routing_before", [False, True])
def test_example_main(name: str, routing_before: bool, capsys: pytest.CaptureFixture,
                      no_vmap_fallback: None) -> None:
    module = importlib.import_module(f"batchrules.examples.{name}")
    with batchrules.enabled(routing_before):
        module.main()
        assert batchrules.is_enabled() == routing_before
    printed = capsys.readouterr().out
    for line in EXPECTED_OUTPUT[name]:
        assert line in printed


# slow: a fresh interpreter per example (importing torch takes seconds); it is what
# users run, and the only check of each example's __main__ entry point.
@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXPECTED_OUTPUT))
def test_example_runs_as_module(name: str) -> None:
    path = os.pathsep.join([str(PACKAGE_PARENT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    env.pop("BATCHRULES_ENABLE", None)
    result = subprocess.run([sys.executable, "-m", f"batchrules.examples.{name}"], env=env,
                            cwd=PACKAGE_PARENT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    for line in EXPECTED_OUTPUT[name]:
        assert line in result.stdout
