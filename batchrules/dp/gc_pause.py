"""The cyclic garbage collector is paused while a clipped_grad step runs.

Note [No cyclic collection during a step]
A step allocates thousands of short-lived Python objects (tensors' wrappers,
the tape's records, torch.func's and pytree's bookkeeping), nearly all freed
by reference counting when it returns. While it runs they push the cyclic
collector past its thresholds: generation-0 and -1 passes over objects that
are all still alive, and now and then a full pass over every object of the
process (~170k once torch is imported). None of them finds garbage the step
made: the cycles a step leaves behind are a few dozen (torch's pytree
closures), collected later as any other. Pausing it takes those passes off
the step's time, the mean more than the median. The collector is restored as
the caller had it, also when the step raises; a collector already off stays
off.
"""
import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Within the block, no automatic cyclic collection (as ``timeit`` runs)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
