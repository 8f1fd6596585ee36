"""``python -m batchrules.bench``: batchrules against stock torch.func, Opacus and
hand-written code, side by side, in one process.

Every scenario runs the *same* user code (torch.func + ``nn.Linear`` /
``F.linear``) with batchrules routing off ("stock") and on ("batchrules"),
next to what an expert would write without vmap ("limit") and, for per-sample
gradients, Opacus' hooks ("opacus"). Every variant is checked against a
float64 for-loop reference before it is timed; variants are timed
round-robin so machine noise hits all of them alike.
"""
from .case import Case, CaseSetup, Variant

__all__ = ["Case", "CaseSetup", "Variant"]
