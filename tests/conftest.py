"""Test set-up: tests/ on sys.path (the shared helpers are the package tests/helpers/), one thread per process."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
