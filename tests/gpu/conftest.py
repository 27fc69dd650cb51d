"""GPU tests (marker ``cuda``; ``make test-gpu``): every test here is skipped, with the reason, where CUDA is not
available. ``PLAIT_GPU_TEST_DEVICE=cpu`` runs them on the CPU instead (a dry run of the test code itself: the
CUDA-only checks, such as torch's sync debug mode, are then skipped)."""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = os.environ.get("PLAIT_GPU_TEST_DEVICE", "cuda")
REASON = "needs a CUDA GPU (run `make test-gpu` on a GPU machine; PLAIT_GPU_TEST_DEVICE=cpu dry-runs the code)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the items of this folder ``cuda``; skip them without a GPU (unless dry-running on the CPU)."""
    here = os.path.dirname(__file__)
    unavailable = DEVICE == "cuda" and not torch.cuda.is_available()
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.cuda)
            if unavailable:
                item.add_marker(pytest.mark.skip(reason=REASON))
