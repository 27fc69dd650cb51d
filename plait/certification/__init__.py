"""``plait certify``: the user's own job trained in one process and under each layout for a few steps on the same
global batches; per step the loss, the gradient norm and per parameter the largest differences; a verdict per
layout (bitwise, equal within a computed budget, or DIFFERS with the first step, parameter gradient and module
that leave the budget) (docs/certify.md).

    api.py          certify(): the reference, each layout, the module-by-module pass of a layout that differs
    job.py          CertifyJob: the job and the layouts, checked before any process starts; a rank's engine
    run.py          what each rank runs (the reference writes whole tensors; a layout compares with them)
    gather.py       whole parameters, gradients and module outputs from a rank's shards
    tape.py         ModuleTape: every module's outputs and output gradients during one step
    budget.py       the budget: fp32 reduction-order rounding, bf16/fp16, Muon's bf16 Newton-Schulz
    compare.py      TensorDiff: largest absolute and relative differences, over the budget
    certificate.py  merging ranks, verdicts, the first divergence and its module
    report.py       certificate.json, summary.md, certificate.png
"""

from plait.certification.api import Certificate, certify
from plait.certification.budget import Budget, budget_for
from plait.certification.certificate import BITWISE, DIFFERS, EQUAL, LayoutCertificate
from plait.certification.job import CertifyJob, parse_layout

__all__ = [
    "BITWISE",
    "DIFFERS",
    "EQUAL",
    "Budget",
    "Certificate",
    "CertifyJob",
    "LayoutCertificate",
    "budget_for",
    "certify",
    "parse_layout",
]
