"""Where ZeRO keeps the fp32 master shards and the optimizer states: device memory, host memory, or files.

Under ZeRO-1/2 each rank owns 1/N of the model states (Rajbhandari et al. 2020). Offload moves that share off
the accelerator:

- ``"none"``: master shards and optimizer states live on the compute device, next to the model.
- ``"cpu"`` (ZeRO-Offload, Ren et al. 2021): they live in host memory and the optimizer step runs on the CPU.
  Per step the shard's gradient goes device -> host (after the reduce-scatter) and the updated shard goes
  host -> device (before the all-gather); with CUDA the host buffers are pinned and the copies
  ``non_blocking``, with one stream synchronisation before the CPU reads the gradients.
- ``"nvme"`` (ZeRO-Infinity, Rajbhandari et al. 2021): as "cpu", and in addition the master shards and
  optimizer state tensors are memory-mapped files (``torch.from_file(path, shared=True)``) under
  ``offload_dir``, so the operating system pages them between RAM and the disk. torch.optim creates its
  state lazily in RAM on the first step and then updates it in place; ``adopt_states`` therefore swaps every
  state tensor for a file-backed copy after a step (and after a checkpoint load), after which the in-place
  updates keep writing the files. Gradients stay in host RAM: they live for one step only.

On a CPU-only machine the compute device is the CPU and "cpu" is only a change of bookkeeping; the observable
is ``Placement.where`` (and the strategy's ``memory_split()``): device vs host vs files.

Files are removed by ``close()``, when the Placement is garbage collected, or at normal interpreter exit
(``weakref.finalize``). A process killed hard (SIGKILL, ``os._exit``, multiprocessing children, which skip
atexit handlers) leaves its folder behind: it is named ``plait-offload-rank{R}-*`` under the temp folder or
``offload_dir``, so it is easy to find and delete.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path

import torch

from plait.logging import get_logger

MODES = ("none", "cpu", "nvme")

log = get_logger(__name__)


def is_file_backed(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s storage is a memory-mapped file."""
    return tensor.device.type == "cpu" and tensor.untyped_storage().filename is not None


def _remove_folder(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


class Placement:
    """Allocates and moves the tensors that offload places: master shards, their gradients, optimizer states."""

    def __init__(self, mode: str, compute_device: torch.device, rank: int = 0, offload_dir: str | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"offload={mode!r} is unknown. Fix: use one of {', '.join(map(repr, MODES))}.")
        self.mode = mode
        self.compute_device = torch.device(compute_device)
        self.device = self.compute_device if mode == "none" else torch.device("cpu")
        """Where master shards, their gradients and the optimizer states live."""
        self.pinned = mode == "cpu" and self.compute_device.type == "cuda"
        """Pinned host buffers (and non_blocking copies) when the model runs on CUDA."""
        self.directory: Path | None = None
        self._files = 0
        self._finalizer: weakref.finalize | None = None
        if mode == "nvme":
            base = offload_dir or tempfile.gettempdir()  # plait.parallelize defaults it from PLAIT_OFFLOAD_DIR
            Path(base).mkdir(parents=True, exist_ok=True)
            self.directory = Path(tempfile.mkdtemp(prefix=f"plait-offload-rank{rank}-", dir=base))
            self._finalizer = weakref.finalize(self, _remove_folder, str(self.directory))
            log.info("nvme offload: master shards and optimizer states are files under %s", self.directory)

    @property
    def offloaded(self) -> bool:
        return self.mode != "none"

    # ----------------------------------------------------------------- allocation
    def _file_tensor(self, numel: int, dtype: torch.dtype, name: str) -> torch.Tensor:
        assert self.directory is not None
        self._files += 1
        path = self.directory / f"{self._files:05d}-{name}.bin"
        # shared=True: writes go to the file (a new file of numel x itemsize zero bytes).
        return torch.from_file(str(path), shared=True, size=numel, dtype=dtype)

    def empty(self, numel: int, dtype: torch.dtype, name: str) -> torch.Tensor:
        """A zero-filled 1-D buffer where this placement keeps long-lived state (a file under "nvme")."""
        if self.mode == "nvme" and numel > 0:
            return self._file_tensor(numel, dtype, name)
        return torch.zeros(numel, dtype=dtype, device=self.device, pin_memory=self.pinned)

    def place(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """A copy of ``tensor`` (any shape) kept where this placement keeps long-lived state."""
        out = self.empty(tensor.numel(), tensor.dtype, name).view(tensor.shape)
        out.copy_(tensor)
        return out

    # ----------------------------------------------------------------- transfers
    def to_host(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``tensor`` (on the compute device) moved to the placement's device as ``dtype``: a shard's gradient
        on its way to the optimizer. Non-blocking into pinned memory with CUDA: call ``synchronize()`` before
        the CPU reads it."""
        if tensor.device == self.device:
            return tensor.to(dtype)
        out = torch.empty(tensor.shape, dtype=dtype, device=self.device, pin_memory=self.pinned)
        out.copy_(tensor, non_blocking=self.pinned)
        return out

    def to_compute(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A master shard brought to the compute device as ``dtype`` (the model's dtype) for the all-gather."""
        moved = tensor.to(self.compute_device, non_blocking=self.pinned)
        return moved.to(dtype)

    def synchronize(self) -> None:
        """Wait for non-blocking device -> host copies (a no-op without pinned CUDA transfers)."""
        if self.pinned:
            torch.cuda.current_stream(self.compute_device).synchronize()

    # ----------------------------------------------------------------- optimizer state
    def adopt_states(self, optimizer: torch.optim.Optimizer) -> int:
        """Under "nvme", replace every optimizer state tensor (dim >= 1) that is not file-backed by a file-backed
        copy; torch.optim then updates it in place, in the file. Returns how many were swapped."""
        if self.mode != "nvme":
            return 0
        swapped = 0
        for index, state in enumerate(optimizer.state.values()):
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.numel() and not is_file_backed(value):
                    state[key] = self.place(value.detach().to(self.device), f"state{index}-{key}")
                    swapped += 1
        return swapped

    # ----------------------------------------------------------------- accounting
    def where(self, tensor: torch.Tensor) -> str:
        """ "files", "host" or "device" for a tensor this placement manages."""
        if is_file_backed(tensor):
            return "files"
        if self.offloaded and tensor.device.type == "cpu":
            return "host"
        return "device"

    def close(self) -> None:
        """Delete this placement's files (tensors mapped from them stay readable until freed)."""
        if self._finalizer is not None:
            self._finalizer()
