"""The test harness: plait's local launcher (``plait.launch``) under the name the tests use."""

from plait.launch import LaunchError, run_local

run_distributed = run_local
DistributedTestError = LaunchError

__all__ = ["DistributedTestError", "LaunchError", "run_distributed"]
