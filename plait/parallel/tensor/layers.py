"""Megatron 1D tensor-parallel layers (Shoeybi et al. 2019), built from the single-device layers they replace.

On t ranks of the ``tp`` axis a linear layer Y = X A^T + b is split two ways (A: [out, in]):

- column parallel: A = [A_1; ...; A_t] by rows (out_features). Rank i computes Y_i = X A_i^T + b_i, its 1/t of
  the output features. The input X must be whole on every rank, so it enters through f = ``copy_to`` (identity
  forward, all-reduce of dX backward: each rank's dX_i = dY_i A_i is a partial sum).
- row parallel: A = [A_1, ..., A_t] by columns (in_features). Rank i holds X_i (a column-parallel output) and
  computes X_i A_i^T; the sum over ranks leaves through g = ``reduce_from`` (all-reduce forward, identity
  backward), and the bias is added once, after the reduce.

A transformer MLP is column -> activation -> row (one all-reduce forward, one backward); attention is q/k/v
column parallel (whole heads per rank) -> core -> o row parallel. With Megatron sequence parallelism
(Korthikanti et al. 2022) the activations outside these regions are split along the sequence, and f/g become
all-gather / reduce-scatter along the sequence dimension (``plait.parallel.tensor.sequence``).

Each layer is made ``from_linear`` / ``from_embedding`` of the single-device layer by slicing its weights, so a
tensor-parallel model built from the same initial weights is the single-device model; parameters keep the
names ``weight`` and ``bias``, and every parameter split over tp carries ``param.tp_shard_dim`` (the tensor dim
that is split) and ``param.tp_sharded = True`` so that norms and gathers can tell them from replicated ones.

Two variants serve Hugging Face models (``plait.parallel.tensor.hf_plans``):
- ``transposed=True``: the weight is stored [in, out], as in GPT-2's ``Conv1D`` (Y = X W + b); the split dims
  swap (column: dim 1, row: dim 0) and the parameter keeps the Conv1D layout, so names and shapes stay the model's.
- ``fused_parts=k``: a fused projection whose outputs are k equal blocks (GPT-2's c_attn = [q | k | v]). Each
  block is split over tp separately, so rank i holds [q_i | k_i | v_i] (its heads of each) in the layout the
  model's ``split`` expects; ``param.tp_fused_parts = k`` lets ``gather_slice`` put the blocks back in order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plait.comm import Comm, all_gather, copy_to, gather_from, reduce_from, reduce_scatter
from plait.errors import LayoutError
from plait.parallel.tensor.fields import optional_tensor_field, tensor_field
from plait.parallel.tensor.grid import whole

AXIS = "tp"
SEQUENCE_DIM = 1
"""Activations are [batch, sequence, features]: sequence parallelism splits dim 1."""


def gather_sequence(x: Tensor, comm: Comm, axis: str = AXIS) -> Tensor:
    """Sequence parallelism entering a tp region: all-gather the sequence chunks (reduce-scatter backward),
    contiguous, so that the layers sharing it save one buffer rather than a copy each."""
    return all_gather(x, comm, axis, dim=SEQUENCE_DIM).contiguous()


def scatter_sequence(x: Tensor, comm: Comm, axis: str = AXIS) -> Tensor:
    """Sequence parallelism leaving a tp region: reduce-scatter along the sequence (all-gather backward)."""
    return reduce_scatter(x, comm, axis, dim=SEQUENCE_DIM).contiguous()


def mark_sharded(param: nn.Parameter, dim: int) -> nn.Parameter:
    """Tag ``param`` as this rank's 1/tp slice along tensor dim ``dim`` (read by norms, gathers, checks)."""
    # torch's stubs declare no attributes beyond Tensor's own; a parameter carries plait's tags fine at runtime
    param.tp_sharded = True  # type: ignore[attr-defined]
    param.tp_shard_dim = dim  # type: ignore[attr-defined]
    return param


def is_tp_sharded(param: torch.Tensor) -> bool:
    """Whether ``param`` is a tensor-parallel slice (False: replicated over the tp ranks)."""
    return bool(getattr(param, "tp_sharded", False))


def tp_shard_dim(param: torch.Tensor) -> int:
    """The tensor dim along which ``param`` is this rank's 1/tp slice (``mark_sharded``'s tag)."""
    dim = getattr(param, "tp_shard_dim", None)
    if not isinstance(dim, int):
        raise LayoutError(
            f"a parameter of shape {tuple(param.shape)} has no tp_shard_dim tag, so it is not a 1D tp slice. "
            f"Fix: tag tp slices with mark_sharded(param, dim)."
        )
    return dim


def padded_size(size: int, parts: int) -> int:
    """``size`` rounded up to a multiple of ``parts`` (the padded vocabulary of ``Layout(tp_pad_vocab=True)``)."""
    return -(-size // parts) * parts


def tp_runs(full: int, parts: int, index: int, fused_parts: int = 1, pad: bool = False) -> list[tuple[int, int]]:
    """The ``(start, length)`` runs of a dim of size ``full`` that rank ``index`` of ``parts`` holds, in the order
    its slice lays them out: its 1/parts chunk, or with ``fused_parts`` = k its chunk of each of the k equal blocks.
    With ``pad`` the dim counts as padded to a multiple of ``parts`` and the runs stop at ``full`` (the slice's
    remaining rows are zeros). What ``_slice`` cuts, and what materialisation reads (``plait.parallel.materialize``)."""
    size = padded_size(full, parts) if pad else full
    block = size // fused_parts
    local = block // parts
    runs = []
    for part in range(fused_parts):
        start = part * block + index * local
        length = min(local, full - start)
        if length > 0:
            runs.append((start, length))
    return runs


def _slice(
    tensor: Tensor, dim: int, comm: Comm, axis: str, what: str, fused_parts: int = 1, pad: bool = False
) -> nn.Parameter:
    """This rank's contiguous 1/t chunk of ``tensor`` along ``dim`` as a new, tagged parameter; with
    ``fused_parts`` = k, the rank's chunk of each of the k equal blocks along ``dim``, concatenated (``tp_runs``).
    ``pad``: ``dim`` counts as padded with zeros to a multiple of t (``param.tp_full_size`` keeps the real size)."""
    parts = comm.size(axis)
    full = tensor.shape[dim]
    size = padded_size(full, parts) if pad else full
    if size % (parts * fused_parts):
        raise LayoutError(
            f"{what}: size {size} of dim {dim} ({fused_parts} fused block(s)) does not split over "
            f"{axis}={parts} ranks. Fix: choose {axis} dividing {size // fused_parts}, or leave this "
            f"layer out of the plan."
        )
    runs = tp_runs(full, parts, comm.mesh.index(axis), fused_parts, pad)
    pieces = [tensor.detach().narrow(dim, start, length) for start, length in runs]
    missing = size // parts - sum(length for _, length in runs)
    if missing:  # a padded vocabulary's rows past the real ones
        shape = list(tensor.shape)
        shape[dim] = missing
        pieces.append(tensor.new_zeros(shape))
    chunk = torch.cat(pieces, dim=dim)
    param = mark_sharded(nn.Parameter(chunk, requires_grad=tensor.requires_grad), dim)
    if fused_parts > 1:
        param.tp_fused_parts = fused_parts  # type: ignore[attr-defined]
    if size != full:
        param.tp_full_size = full  # type: ignore[attr-defined]
    return param


def _matmul(x: Tensor, weight: Tensor, bias: Tensor | None, transposed: bool) -> Tensor:
    """X A^T + b for an [out, in] weight, X W + b for a transposed [in, out] one (computed as Conv1D does)."""
    if not transposed:
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    y = torch.addmm(bias, flat, weight) if bias is not None else flat @ weight
    return y.view(*x.shape[:-1], weight.shape[1])


class ColumnParallelLinear(nn.Module):
    """Y_i = f(X) A_i^T + b_i: output features split over tp (``gather_output`` all-gathers them back).

    ``input_mode`` says how X enters: "copy" (f = identity fwd / all-reduce bwd), "sequence" (Megatron-SP:
    all-gather of the sequence shards fwd / reduce-scatter bwd), or "entered" (a parent module already did
    it once for several column layers sharing X, e.g. q/k/v: see ``plait.parallel.tensor.plan``).
    ``gather_output="eval"`` keeps the output split in training (for a vocab-parallel loss) and gathers it in
    evaluation, so metrics such as accuracy see whole logits. ``transposed``: the weight is [in, out_local].
    """

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        comm: Comm,
        axis: str = AXIS,
        gather_output: bool | str = False,
        input_mode: str = "copy",
        transposed: bool = False,
        out_features: int | None = None,
    ) -> None:
        super().__init__()
        if gather_output not in (True, False, "eval"):
            raise ValueError(f"gather_output={gather_output!r}: use True, False or 'eval'")
        if input_mode not in ("copy", "sequence", "entered"):
            raise ValueError(f"input_mode={input_mode!r}: use 'copy', 'sequence' or 'entered'")
        self.weight = weight
        self.bias = bias
        self.comm, self.axis = comm, axis
        self.gather_output = gather_output
        self.input_mode = input_mode
        self.transposed = transposed
        local = weight.shape[1 if transposed else 0]
        self.out_features = out_features if out_features is not None else local * comm.size(axis)
        """The real output width; less than the padded local x tp under ``pad`` (a padded vocabulary)."""

    @classmethod
    def from_linear(
        cls,
        linear: nn.Module,
        comm: Comm,
        axis: str = AXIS,
        gather_output: bool | str = False,
        input_mode: str = "copy",
        name: str = "linear",
        transposed: bool = False,
        fused_parts: int = 1,
        pad: bool = False,
    ) -> ColumnParallelLinear:
        """From an nn.Linear (weight [out, in]) or, with ``transposed``, a Conv1D (weight [in, out]). ``pad``:
        out_features padded with zero rows to a multiple of tp; their outputs are -inf (no probability under a
        softmax, zero gradient) and the gathered output is cut back to out_features."""
        dim = 1 if transposed else 0
        full_weight, full_bias = tensor_field(linear, "weight"), optional_tensor_field(linear, "bias")
        weight = _slice(full_weight, dim, comm, axis, f"{name} (column parallel, out_features)", fused_parts, pad)
        bias = None if full_bias is None else _slice(full_bias, 0, comm, axis, f"{name}.bias", fused_parts, pad)
        return cls(weight, bias, comm, axis, gather_output, input_mode, transposed, full_weight.shape[dim])

    def enter(self, x: Tensor) -> Tensor:
        """X entering the tp region (``input_mode``); a chunked loss enters once and ``project``s chunks."""
        if self.input_mode == "copy":
            return copy_to(x, self.comm, self.axis)
        if self.input_mode == "sequence":
            return gather_sequence(x, self.comm, self.axis)
        return x

    def project(self, x: Tensor) -> Tensor:
        """This rank's output columns of an entered X (padded columns -inf)."""
        y = _matmul(x, self.weight, self.bias, self.transposed)
        start = self.comm.mesh.index(self.axis) * y.shape[-1]
        if start + y.shape[-1] > self.out_features:  # padded columns on this rank: out of every softmax
            padded = torch.arange(start, start + y.shape[-1], device=y.device) >= self.out_features
            y = y.masked_fill(padded, float("-inf"))
        return y

    def forward(self, x: Tensor) -> Tensor:
        y = self.project(self.enter(x))
        gather = self.gather_output is True or (self.gather_output == "eval" and not self.training)
        return gather_from(y, self.comm, self.axis, dim=-1)[..., : self.out_features] if gather else y

    def extra_repr(self) -> str:
        out_local, in_features = self.weight.shape[::-1] if self.transposed else self.weight.shape
        return (
            f"in={in_features}, out_local={out_local}, bias={self.bias is not None}, axis={self.axis!r}, "
            f"input={self.input_mode}, gather_output={self.gather_output}, transposed={self.transposed}"
        )


class RowParallelLinear(nn.Module):
    """Y = g(X_i A_i^T) + b: input features split over tp; the partial products are summed by an all-reduce
    (``sequence_parallel``: reduce-scattered along the sequence instead), then the whole bias is added once."""

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        comm: Comm,
        axis: str = AXIS,
        sequence_parallel: bool = False,
        transposed: bool = False,
    ) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.comm, self.axis = comm, axis
        self.sequence_parallel = sequence_parallel
        self.transposed = transposed

    @classmethod
    def from_linear(
        cls,
        linear: nn.Module,
        comm: Comm,
        axis: str = AXIS,
        sequence_parallel: bool = False,
        name: str = "linear",
        transposed: bool = False,
    ) -> RowParallelLinear:
        """From an nn.Linear (weight [out, in]) or, with ``transposed``, a Conv1D (weight [in, out])."""
        full_weight, full_bias = tensor_field(linear, "weight"), optional_tensor_field(linear, "bias")
        weight = _slice(full_weight, 0 if transposed else 1, comm, axis, f"{name} (row parallel, in_features)")
        bias = (
            None
            if full_bias is None
            else nn.Parameter(full_bias.detach().clone(), requires_grad=full_bias.requires_grad)
        )
        return cls(weight, bias, comm, axis, sequence_parallel, transposed)

    def forward(self, x: Tensor) -> Tensor:
        partial = _matmul(x, self.weight, None, self.transposed)
        if self.sequence_parallel:
            y = scatter_sequence(partial, self.comm, self.axis)
        else:
            y = reduce_from(partial, self.comm, self.axis)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        out, in_local = self.weight.shape[::-1] if self.transposed else self.weight.shape
        return (
            f"in_local={in_local}, out={out}, bias={self.bias is not None}, axis={self.axis!r}, "
            f"sequence_parallel={self.sequence_parallel}, transposed={self.transposed}"
        )


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the table on each rank: ids outside the range look up row 0 and are zeroed, so the
    all-reduce (``sequence_parallel``: reduce-scatter along the sequence) of the partial lookups is the lookup."""

    def __init__(
        self,
        weight: nn.Parameter,
        vocab_start: int,
        comm: Comm,
        axis: str = AXIS,
        sequence_parallel: bool = False,
        padding_idx: int | None = None,
    ) -> None:
        super().__init__()
        self.weight = weight
        self.vocab_start = vocab_start
        self.vocab_end = vocab_start + weight.shape[0]
        self.comm, self.axis = comm, axis
        self.sequence_parallel = sequence_parallel
        self.padding_idx = padding_idx
        """Local row of the single-device padding_idx when this rank holds it (its gradient stays zero)."""

    @classmethod
    def from_embedding(
        cls,
        embedding: nn.Embedding,
        comm: Comm,
        axis: str = AXIS,
        sequence_parallel: bool = False,
        name: str = "embedding",
        pad: bool = False,
    ) -> VocabParallelEmbedding:
        """``pad``: the table padded with zero rows to a multiple of tp (no id reaches them)."""
        if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
            raise LayoutError(
                f"{name}: a vocab-parallel embedding supports neither max_norm, scale_grad_by_freq nor sparse=True. "
                f"Fix: build the embedding without them, or leave {name} out of the tensor-parallel plan."
            )
        weight = _slice(embedding.weight, 0, comm, axis, f"{name} (vocab parallel, num_embeddings)", pad=pad)
        start = comm.mesh.index(axis) * weight.shape[0]
        padding = embedding.padding_idx
        local_padding = padding - start if padding is not None and start <= padding < start + weight.shape[0] else None
        return cls(weight, start, comm, axis, sequence_parallel, local_padding)

    def forward(self, ids: Tensor) -> Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight, self.padding_idx).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return scatter_sequence(partial, self.comm, self.axis)
        return reduce_from(partial, self.comm, self.axis)

    def extra_repr(self) -> str:
        return (
            f"rows=[{self.vocab_start}, {self.vocab_end}), dim={self.weight.shape[1]}, axis={self.axis!r}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


@torch.no_grad()
def gather_slice(tensor: Tensor, param: Tensor, comm: Comm, axis: str = AXIS) -> Tensor:
    """The whole tensor of which ``tensor`` (``param`` itself, or its gradient) is this rank's tp slice: an
    all-gather along ``param.tp_shard_dim``; a fused parameter's blocks are put back in order (the gather gives
    [q_0 k_0 v_0 | q_1 k_1 v_1], the model's layout is [q_0 q_1 | k_0 k_1 | v_0 v_1]). A 2D / 2.5D / 3D grid
    block (``param.tp_grid_placement``) is all-gathered over the tp sub-axes instead."""
    if hasattr(param, "tp_grid_placement"):
        return whole(tensor, comm, param.tp_grid_placement)
    dim = tp_shard_dim(param)
    gathered = comm.all_gather(tensor.detach().contiguous(), axis, dim=dim)
    fused = getattr(param, "tp_fused_parts", 1)
    if fused > 1:
        per_rank = [piece.chunk(fused, dim=dim) for piece in gathered.chunk(comm.size(axis), dim=dim)]
        gathered = torch.cat([blocks[part] for part in range(fused) for blocks in per_rank], dim=dim)
    if hasattr(param, "tp_full_size"):  # a padded vocabulary: the model's rows only
        gathered = gathered.narrow(dim, 0, param.tp_full_size)
    return gathered.clone()


@torch.no_grad()
def gather_parameters(model: nn.Module, comm: Comm, axis: str = AXIS) -> dict[str, Tensor]:
    """Every parameter of ``model`` whole, by name: tp slices all-gathered along their ``tp_shard_dim`` (grid
    blocks over the tp sub-axes; the same call on every tp rank, in name order); replicated parameters copied.
    For checks and export."""
    out: dict[str, Tensor] = {}
    for name, param in model.named_parameters():
        out[name] = gather_slice(param, param, comm, axis) if is_tp_sharded(param) else param.detach().clone()
    return out


__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "gather_parameters",
    "gather_sequence",
    "gather_slice",
    "is_tp_sharded",
    "mark_sharded",
    "padded_size",
    "scatter_sequence",
    "tp_runs",
    "tp_shard_dim",
]
