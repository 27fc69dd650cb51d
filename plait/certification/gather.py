"""Whole tensors from a rank's shards: parameters and gradients (through the metadata checkpoints unshard with),
and module outputs (activations and their gradients) for the module-by-module comparison.

Parameters and gradients: the strategy's ``full_parameters`` / ``full_gradients`` gather ZeRO's flat shards over
dp x cp; each tensor-parallel slice or expert slice is then placed where ``plait.checkpoint.chunks.whole_pieces``
(the checkpoint's own placement: fused blocks such as a fused qkv, padded vocabularies, expert offsets) puts it
in a zero tensor of the single-device shape, and the tensors are summed over tp and ep. Every element is held by
exactly one rank of those groups, so the sum adds only zeros to it: exact.

Activations: a module's outputs of this rank's micro-batches are concatenated (the rows of a micro-batch follow
those of the one before), then gathered over dp (rows: rank r holds rows [rG/n, (r+1)G/n)), over Megatron-SP's tp
and cp along the sequence (dimension 1, or 2 for an attention core's [B, H, T, D]; cp's zigzag or contiguous order
put back by ``SequenceSharding.gathered_order``), and over tp along a feature dimension that tp splits (fused
blocks re-ordered). A tensor that still does not have the single-device shape is "not comparable" (e.g. an
expert's dispatched tokens): skipped, and listed as such.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.checkpoint.chunks import global_shape, whole_pieces
from plait.parallel.context.sharding import SequenceSharding


def _placed(engine: Any, name_to_param: dict[str, nn.Parameter], local: dict[str, torch.Tensor]) -> dict:
    """``local`` tensors (tp / ep slices by parameter name) as whole single-device tensors on the CPU."""
    comm, mesh = engine.comm, engine.mesh
    tp_size, tp_rank = mesh.size("tp"), mesh.index("tp")
    ep_size = mesh.size("ep") if engine.layout.ep > 1 else 1
    out: dict[str, torch.Tensor] = {}
    for name, param in name_to_param.items():
        if name not in local:
            continue
        tensor = local[name].detach()
        sliced_tp = tp_size > 1 and bool(getattr(param, "tp_sharded", False))
        sliced_ep = ep_size > 1 and getattr(param, "ep_slice", None) is not None
        if sliced_tp or sliced_ep:
            whole = torch.zeros(global_shape(param, tensor.shape, tp_size), dtype=tensor.dtype, device=tensor.device)
            for piece in whole_pieces(tensor, param, tp_rank, tp_size):
                region = whole
                for dim, (offset, size) in enumerate(zip(piece.offsets, piece.view.shape)):
                    region = region.narrow(dim, offset, size)
                region.copy_(piece.view)
            if sliced_tp:
                comm.all_reduce(whole, "tp")
            if sliced_ep:
                comm.all_reduce(whole, "ep")
            tensor = whole
        out[name] = tensor.float().cpu().clone()
    return out


def whole_parameters(engine: Any) -> dict[str, torch.Tensor]:
    """This rank's parameters as whole fp32 CPU tensors by the single-device model's names (a collective)."""
    params = dict(engine.model.named_parameters())
    return _placed(engine, params, engine.strategy.full_parameters())


def whole_gradients(engine: Any) -> dict[str, torch.Tensor]:
    """This rank's synchronised gradients, whole (a collective: call it on every rank at the same point)."""
    params = dict(engine.model.named_parameters())
    strategy = engine.strategy
    if hasattr(strategy, "full_gradients"):
        local = strategy.full_gradients()
    else:
        local = {name: p.grad for name, p in params.items() if p.grad is not None}
    return _placed(engine, params, local)


def _unfuse(parts: list[torch.Tensor], fused: int, dim: int) -> torch.Tensor:
    """Rank-ordered tp slices of a fused output ([q_r, k_r, v_r] on rank r) back in the whole order [q, k, v]."""
    pieces = [part.chunk(fused, dim) for part in parts]
    return torch.cat([pieces[r][f] for f in range(fused) for r in range(len(parts))], dim)


def _sequence_dim(tensor: torch.Tensor, whole_shape: torch.Size, seq_len: int) -> int | None:
    """The dimension holding the sequence: 1 for [B, T, ...] (hidden states, logits, a rotary table), 2 for an
    attention core's [B, H, T, D] (heads before the sequence); None for anything else."""
    if tensor.dim() < 2 or len(whole_shape) != tensor.dim():
        return None
    if whole_shape[1] == seq_len:
        return 1
    return 2 if tensor.dim() == 4 and whole_shape[2] == seq_len else None


def whole_activation(
    engine: Any, tensor: torch.Tensor, whole_shape: torch.Size, seq_len: int, fused: int = 1
) -> torch.Tensor | None:
    """``tensor`` (this rank's micro-batches' outputs, concatenated) gathered to ``whole_shape``; None when it
    cannot be (a collective over dp, cp and tp: every peer decides alike from the shapes alone)."""
    comm, mesh, layout = engine.comm, engine.mesh, engine.layout
    tensor = tensor.detach().float().contiguous()
    if tensor.dim() == 0:
        return tensor.cpu() if tensor.shape == whole_shape else None
    if layout.dp > 1:
        tensor = comm.all_gather(tensor, "dp", dim=0)
    seq = _sequence_dim(tensor, whole_shape, seq_len)
    if seq is not None:
        if (
            layout.sequence_parallel
            and layout.tp > 1
            and seq == 1
            and tensor.shape[1] * layout.tp * layout.cp == seq_len
        ):
            tensor = comm.all_gather(tensor.contiguous(), "tp", dim=1)
        if layout.cp > 1 and tensor.shape[seq] * layout.cp == seq_len:
            gathered = comm.all_gather(tensor.contiguous(), "cp", dim=seq)
            order = SequenceSharding(layout.cp_mode, layout.cp, mesh.index("cp")).gathered_order(seq_len)
            tensor = gathered.index_select(seq, torch.argsort(order).to(gathered.device))
    if layout.tp > 1 and tensor.dim() == len(whole_shape):
        for dim in range(tensor.dim()):
            if tensor.shape[dim] != whole_shape[dim] and tensor.shape[dim] * layout.tp == whole_shape[dim]:
                parts = list(comm.all_gather(tensor.contiguous(), "tp", dim=dim).chunk(layout.tp, dim))
                tensor = _unfuse(parts, fused, dim) if fused > 1 else torch.cat(parts, dim)
                break
    return tensor.cpu() if tensor.shape == whole_shape else None
