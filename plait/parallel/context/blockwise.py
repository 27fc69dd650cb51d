"""Attention over one (query rows, key block) pair with its log-sum-exp, the online-softmax merge, and the
FlashAttention backward of a block (Dao et al. 2022, alg. 2/4; Milakov & Gimelshein 2018).

For scores s_ij = q_i . k_j * scale over a block, the block yields o_i = sum_j exp(s_ij - l_i) v_j and
l_i = log sum_j exp(s_ij). Two partial results over disjoint key sets merge exactly:

    l = log(exp(l_a) + exp(l_b)),   o = exp(l_a - l) o_a + exp(l_b - l) o_b

so visiting the key blocks one by one in any order gives full softmax attention. Backward needs only the
final (o, l): with P_ij = exp(s_ij - l_i) and delta_i = dO_i . o_i,
dV = P^T dO, dS = P * (dO V^T - delta), dQ = dS K * scale, dK = dS^T Q * scale, block by block.
Everything is computed in float32 (the accumulators' dtype) whatever the inputs' dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _scores(q: Tensor, k: Tensor, scale: float, causal: bool, mask: Tensor | None = None) -> Tensor:
    """q k^T * scale in float32, [..., Tq, Tk]; with ``causal`` (Tq == Tk, aligned) the upper triangle is -inf;
    ``mask`` (boolean, broadcast to the scores: True where a query sees a key) sets the rest of what it hides to
    -inf (packed documents: ``plait.parallel.context.documents``)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        return scores.masked_fill(~mask, float("-inf"))
    if causal:
        rows, cols = scores.shape[-2:]
        hidden = torch.ones(rows, cols, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores


def block_forward(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """(o, l) of queries ``q`` [B, H, Tq, D] over keys/values [B, H, Tk, D]: float32 [B, H, Tq, D] and [B, H, Tq].
    With a ``mask`` (which already holds causality) a query may see none of the block's keys: its l is -inf and
    its o zero, which the merge then ignores."""
    scores = _scores(q, k, scale, causal, mask)
    lse = torch.logsumexp(scores, dim=-1)
    shift = lse if mask is None else lse.masked_fill(lse == float("-inf"), 0.0)
    out = torch.matmul(torch.exp(scores - shift.unsqueeze(-1)), v.float())
    return out, lse


def merge_into(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold a block's (o_b, l_b) into the running (o, l) in place (float32 views of the accumulators)."""
    merged = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - merged).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - merged).unsqueeze(-1))
    lse.copy_(merged)


def block_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    grad_out: Tensor,
    lse: Tensor,
    delta: Tensor,
    scale: float,
    causal: bool,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) in float32 of one block, recomputing its probabilities from the final ``lse``;
    ``delta`` = rowsum(dO * o) of the final output; ``mask`` as in ``block_forward``."""
    probs = torch.exp(_scores(q, k, scale, causal, mask) - lse.unsqueeze(-1))
    grad_out = grad_out.float()
    grad_v = torch.matmul(probs.transpose(-1, -2), grad_out)
    grad_scores = probs * (torch.matmul(grad_out, v.float().transpose(-1, -2)) - delta.unsqueeze(-1))
    grad_q = torch.matmul(grad_scores, k.float()) * scale
    grad_k = torch.matmul(grad_scores.transpose(-1, -2), q.float()) * scale
    return grad_q, grad_k, grad_v


def repeat_kv(x: Tensor, group: int) -> Tensor:
    """[B, KV, T, D] -> [B, KV*group, T, D]: each key/value head serves ``group`` consecutive query heads."""
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def sum_kv_groups(grad: Tensor, group: int) -> Tensor:
    """The adjoint of ``repeat_kv``: [B, KV*group, T, D] -> [B, KV, T, D], summing each head's group."""
    if group == 1:
        return grad
    batch, heads, length, dim = grad.shape
    return grad.view(batch, heads // group, group, length, dim).sum(dim=2)
