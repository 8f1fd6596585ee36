"""Short, runnable examples of batchrules routing in the three torch.func flows.

Each module runs as ``python -m batchrules.examples.<name>`` and exposes the
functions it demonstrates, so they can be imported and reused:

- ``hypernetwork``: vmap over per-sample weights produced by a hypernetwork.
- ``ensembling``: N stacked copies of an MLP, run and trained under vmap.
- ``per_sample_grads``: per-sample gradients and a DP-SGD step.
- ``dp_sgd``: DP-SGD training with ``batchrules.clipped_grad`` (Opacus' accountant, DDP, FSDP2,
  logical batches; its multi-process runs in ``dp_sgd_ranks``).
- ``recurrent_ensemble``: an ensemble of GRU dynamics models trained in one vmapped step.
- ``lstm_per_sample_grads``: per-sample gradients of an LSTM classifier, checked in float64.
- ``inspect_routing``: confirm with the profiler that routing is active.
"""
