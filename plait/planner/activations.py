"""Activation memory: the bytes one micro-batch's forward keeps for backward, block by block, and the buffers of
the loss. Two accountings, chosen by the implementation being modelled (``Implementation.state_accounting``):

**"plait"**: plait's reference GPT tensor by tensor, as ``plait.observe.memory.SavedActivations`` measures it
(tests/test_recompute.py and tests/test_memory.py hold it to the byte). Per block, for b samples of s tokens
(this rank's: s / cp), width h, a heads of width d (k key/value heads), MLP width f, tensor parallelism t,
n = t with sequence parallelism (else 1); e bytes per compute-dtype element (2 under bf16/fp16 autocast, 4 in
fp32); r = 4 bytes for the residual stream (plait keeps fp32 weights, so embeddings and residual adds stay fp32
under autocast); c the number of matmuls that read a norm's output (3 for q/k/v, 1 or 2 for a GELU or SwiGLU
MLP: under autocast each casts its own copy, in fp32 they share the norm's output):

    two norms      2 [r s b h / n + stats / n]     stats: mean and rstd 8 s b (LayerNorm); RMSNorm: rsqrt
                                                   4 s b and its normalised input r s b h
    matmul inputs  (c_attn + c_mlp) e s b h        autocast: one copy per matmul; fp32: 2 r s b h (shared). Whole
                                                   under SP (plait keeps the gathered inputs, docs/tensor_parallel.md)
    q, k, v        3 e s b h / t                   what the core keeps: k, v repeated to a heads (GQA)
    core, flash    e s b h / t + 4 a s b / t       SDPA flash / memory-efficient: its output (o's input) and the
                                                   log-sum-exp: no s^2 term (Dao et al. 2022)
    core, math     e s b h / t + 4 a s^2 b / t     o's input and the fp32 softmax; q, k, v are kept as 4-byte
                                                   copies (torch's math kernel upcasts bf16/fp16), so 12 s b h / t
                                                   replaces 3 e s b h / t; dropout p > 0 adds its mask (m a s^2 b
                                                   / t) and the dropped probabilities (4 a s^2 b / t)
    MLP            2 e s b f / t (GELU: up's output, GELU's)    4 e s b f / t (SwiGLU: gate, SiLU, up, product)
    RoPE           16 s d (cos and sin of q and of k, fp32; 16 b s d with per-sample positions)
    weight copies  e (h (h + 2 k d) + h^2 + (2|3) h f) / t      autocast's cached low-precision weights, which
                                                   the matmuls save (none in fp32: they save the parameters)
    dropout p > 0  2 m s b h / n                   the two residual dropouts' masks (m bytes an element: 1 for
                                                   CUDA's native_dropout, the dtype's on CPU)

In fp32 with LayerNorm, GELU, learned positions, flash attention and no dropout that is
4 (16 s b h + 4 s b + a s b) bytes: the single-device row of docs/tensor_parallel.md. With ``recompute``:

- "selective" (the attention core is recomputed, Korthikanti et al. 2022 sec. 5): the core keeps nothing but its
  inputs q, k, v before the kv repetition, e s b (a + 2 k) d / t, and o still keeps the core's output; the
  log-sum-exp (flash) or the s^2 softmax, masks and dropped probabilities (math) are gone.
- "op" (per operator, ``plait.parallel.recompute.OperatorPolicy``): the block keeps its input, r s b h / n (and
  the positions, as under "full"), and the outputs of q, v (e s b k d / t), the attention kernel when it is a
  fused one (flash: e s b h / t and its log-sum-exp, 4 a s b / t; math: nothing, the core is recomputed), the
  MLP's first matmul (e s b f / t) and, in a gated MLP, down (e s b h: row-parallel, its output is whole before
  its all-reduce or reduce-scatter): the 1st, 3rd, 5th and 7th matmuls of a block with separate q, k, v
  projections (plait's, torchtitan's and Hugging Face Llama's blocks).
- "full" (or the listed blocks): the block keeps only its input, r s b h / n (and, once per micro-batch, the
  positions handed to every block: 8 s bytes); while a recomputed block runs again in backward, its whole
  activations exist for a moment (under "op", what it recomputes).

Outside the blocks: the first stage saves the token ids (8 s b) and, with learned positions, the positions (8 s);
the last stage its final norm and the head's input (as a block's norm and matmul input), the head's weight copy
under autocast (e h V / t), the loss's fp32 log-softmax (4 s b V / t, ``lm_loss`` upcasts the logits), the
targets (8 s b) and a scalar. When the backward of a micro-batch begins, the loss's gradient and the
log-softmax's input gradient (4 s b V / t each, fp32) exist besides everything saved: ``loss_buffer_bytes``.
With chunked cross-entropy (``loss_chunk`` = c tokens, ``plait.models.loss.HeadChunks``) each chunk is
checkpointed: the last stage keeps its final norm, the head's input as the chunks' input (the fp32 hidden
states, r s b h: the checkpoint keeps no autocast copy and no weight copy), the targets, and no logits; in
backward one chunk's logits are recomputed at a time, so the loss buffers are those of c' = min(c, s b) tokens:
its fp32 log-softmax, its gradient and its input's gradient, 12 c' V / t.

**"korthikanti"**: Korthikanti et al. 2022, eqs. 2-6, for a Megatron-style implementation (2-byte activations,
1-byte dropout masks; scaled by e / 2), written term by term so that the block's shape counts (grouped-query
attention, the MLP's width, a gated MLP, no dropout; ``korthikanti_block_bytes``): for GPT-3's shape with dropout,
s b h (34 + 5 a s / h) per block, s b h (10 + 24 / t + 5 a s / (h t)) with tensor parallelism, s b h (34 + 5 a s /
h) / t with sequence parallelism; "selective" (and a fused flash kernel) drops the 5 a s^2 b term; "full" keeps
2 s b h (/ t with SP); "op" the input and the kept matmul and attention outputs, as above at 2 bytes. The last
stage keeps the fp32 logits (4 s b V / t, their sec. 4.3).
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.layout import Precision
from plait.models.spec import ModelSpec

ATTENTION_KERNELS = ("flash", "math")
"""flash: a fused SDPA kernel (flash / memory-efficient / CPU flash) that keeps only the log-sum-exp; math: the
unfused kernel that keeps the softmax (torch's math backend, Hugging Face's eager attention)."""
ACCOUNTINGS = ("plait", "korthikanti")


@dataclass(frozen=True)
class Forward:
    """How one micro-batch's forward runs on this rank: ``batch`` samples of ``seq`` tokens (this rank's share of
    the sequence: s / cp), ``precision`` (autocast dtype; "fp32": none), tensor parallel degree ``tp`` with or
    without sequence parallelism, the attention kernel, dropout probability and its mask's bytes per element
    (None: the dtype's, as on CPU; 1 on CUDA), and whether positions are per sample (context parallelism)."""

    batch: int
    seq: int
    precision: str = "fp32"
    tp: int = 1
    sequence_parallel: bool = False
    attention: str = "flash"
    dropout: float = 0.0
    mask_bytes: int | None = None
    per_sample_positions: bool = False
    loss_chunk: int = 0
    """Chunked cross-entropy: tokens per chunk of the LM head and loss (0: whole logits)."""

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"attention={self.attention!r} is unknown; use one of {ATTENTION_KERNELS}")
        if isinstance(self.loss_chunk, bool) or not isinstance(self.loss_chunk, int) or self.loss_chunk < 0:
            raise ValueError(f"loss_chunk={self.loss_chunk!r} must be an integer >= 0 (0: whole logits)")

    @property
    def e(self) -> int:
        """Bytes of a compute-dtype element."""
        return 4 if self.precision == Precision.FP32 else 2

    @property
    def autocast(self) -> bool:
        return self.precision != Precision.FP32

    @property
    def n(self) -> int:
        """The split of the norm / dropout / residual regions: tp under sequence parallelism, else 1."""
        return self.tp if self.sequence_parallel and self.tp > 1 else 1

    def mask(self, element_bytes: int) -> int:
        return element_bytes if self.mask_bytes is None else self.mask_bytes


RESIDUAL_BYTES = 4
"""The residual stream's element (fp32: plait's parameters, hence embeddings and residual adds, stay fp32)."""


# ---------------------------------------------------------------------- plait's own model, tensor by tensor
def _norm_site(spec: ModelSpec, fwd: Forward) -> float:
    """A norm's saved input and statistics (its output is counted by the matmuls that read it)."""
    sb, sbh, n = fwd.batch * fwd.seq, fwd.batch * fwd.seq * spec.hidden, fwd.n
    if spec.uses_rms_norm:  # rsqrt (fp32) and the normalised input that multiplies the weight
        return (RESIDUAL_BYTES * sbh + 4 * sb + RESIDUAL_BYTES * sbh) / n
    return (RESIDUAL_BYTES * sbh + 8 * sb) / n


def _matmul_inputs(spec: ModelSpec, fwd: Forward, readers: int) -> float:
    """What the ``readers`` matmuls that read one norm's output keep of it: one copy each under autocast."""
    sbh = fwd.batch * fwd.seq * spec.hidden
    return readers * fwd.e * sbh if fwd.autocast else RESIDUAL_BYTES * sbh


def core_internal_bytes(spec: ModelSpec, fwd: Forward) -> float:
    """What the attention core keeps beyond its inputs and its output: the bytes selective recomputation drops
    (flash: the log-sum-exp; math: the fp32 softmax, and with dropout its mask and the dropped probabilities;
    math also keeps 4-byte copies of q, k, v where a fused kernel keeps the e-byte ones)."""
    b, s, t, a = fwd.batch, fwd.seq, fwd.tp, spec.heads
    if fwd.attention == "flash":
        return 4 * a * s * b / t
    squares = a * s * s * b / t
    internal = 4 * squares + (fwd.mask(4) * squares + 4 * squares if fwd.dropout > 0 else 0.0)
    return internal + 3 * (4 - fwd.e) * b * s * spec.q_width / t  # the upcast q, k, v beyond the e-byte ones


def plait_block_bytes(spec: ModelSpec, fwd: Forward, recompute: str = "none") -> float:
    """Bytes one of plait's blocks keeps for backward for one micro-batch (module docstring); ``recompute``:
    "none", "selective" or "full" (this block recomputed whole)."""
    b, s, t, h = fwd.batch, fwd.seq, fwd.tp, spec.hidden
    sb, sbh, sbf = b * s, b * s * h, b * s * spec.ffn
    if recompute == "full":
        return RESIDUAL_BYTES * sbh / fwd.n
    if recompute == "op":
        return RESIDUAL_BYTES * sbh / fwd.n + fwd.e * _operator_outputs(spec, fwd) + _kernel_statistics(spec, fwd)
    norms = 2 * _norm_site(spec, fwd)
    inputs = _matmul_inputs(spec, fwd, 3) + _matmul_inputs(spec, fwd, 2 if spec.gated else 1)
    sbq = b * s * spec.q_width  # sbh unless the heads are not h / a wide (``ModelSpec.attention_head_dim``)
    output = fwd.e * sbq / t  # the core's output, o's input
    if recompute == "selective":  # the checkpoint keeps q, k, v as they enter the core (before the kv repetition)
        qkv = fwd.e * sb * (spec.heads + 2 * spec.kv) * spec.head_dim / t
        core = 0.0
    elif recompute == "none":
        qkv = 3 * fwd.e * sbq / t
        core = core_internal_bytes(spec, fwd)
    else:
        raise ValueError(f"recompute={recompute!r} is not a per-block choice; use 'none', 'selective', 'op' or 'full'")
    mlp = (4 if spec.gated else 2) * fwd.e * sbf / t
    rope = 0.0 if spec.learned_positions else 16 * s * spec.head_dim * (b if fwd.per_sample_positions else 1)
    weights = fwd.e * spec.matmul_parameters / t if fwd.autocast else 0.0
    dropout = 2 * fwd.mask(fwd.e) * sbh / fwd.n if fwd.dropout > 0 else 0.0
    return norms + inputs + qkv + output + core + mlp + rope + weights + dropout


def _operator_outputs(spec: ModelSpec, fwd: Forward) -> float:
    """Elements of the outputs "op" keeps per block beside its input: q, v, the fused attention kernel's output,
    the MLP's first matmul (each split by t) and, gated, down (module docstring). Down is row-parallel under tp:
    its matmul's output is whole (partial sums, before their all-reduce or reduce-scatter)."""
    b, s, t, h, q = fwd.batch, fwd.seq, fwd.tp, spec.hidden, spec.q_width
    attention = q if fwd.attention == "flash" else 0
    return b * s * ((q + spec.kv * spec.head_dim + attention + spec.ffn) / t + (h if spec.gated else 0))


def _kernel_statistics(spec: ModelSpec, fwd: Forward) -> float:
    """The fused attention kernel's fp32 log-sum-exp, kept with its output under "op"."""
    return 4 * spec.heads * fwd.seq * fwd.batch / fwd.tp if fwd.attention == "flash" else 0.0


def positions_bytes(fwd: Forward) -> float:
    """The int64 positions of one micro-batch (per sample under context parallelism): what a stage hands its
    checkpointed blocks, kept once per micro-batch as their input."""
    return 8 * fwd.seq * (fwd.batch if fwd.per_sample_positions else 1)


def plait_embedding_bytes(spec: ModelSpec, fwd: Forward, blocks_recomputed: bool = False) -> float:
    """What the first stage keeps outside its blocks: the token ids, the positions (learned position embedding,
    or handed to recomputed blocks), the embedding dropout's mask."""
    b, s = fwd.batch, fwd.seq
    kept = 8 * b * s + (positions_bytes(fwd) if spec.learned_positions or blocks_recomputed else 0.0)
    if fwd.dropout > 0:
        kept += fwd.mask(RESIDUAL_BYTES) * b * s * spec.hidden / fwd.n
    return kept


def plait_head_bytes(spec: ModelSpec, fwd: Forward) -> float:
    """What the last stage keeps outside its blocks: the final norm, the head's input (and weight copy under
    autocast), the loss's fp32 log-softmax, the targets and the loss's total weight; with chunked cross-entropy
    the final norm, the fp32 head input the chunks keep and the targets (module docstring)."""
    b, s, t = fwd.batch, fwd.seq, fwd.tp
    if fwd.loss_chunk:
        return _norm_site(spec, fwd) + RESIDUAL_BYTES * b * s * spec.hidden + 8 * b * s
    weights = fwd.e * spec.hidden * spec.vocab / t if fwd.autocast else 0.0
    return _norm_site(spec, fwd) + _matmul_inputs(spec, fwd, 1) + weights + 4 * b * s * spec.vocab / t + 8 * b * s + 4


# ---------------------------------------------------------------------- Korthikanti et al. 2022
def korthikanti_block_bytes(spec: ModelSpec, fwd: Forward, recompute: str = "none") -> float:
    """Korthikanti et al. 2022, eqs. 2-6, term by term for the block's shape, for one block and micro-batch, scaled
    to ``fwd``'s element size (their 2-byte activations, 1-byte dropout masks). In units of s b h bytes, with
    m = 1 when the model trains with dropout (``fwd.dropout`` > 0), else 0; k / a the key/value share of the heads:

        replicated (split by t only under SP)   4 (the two norms' inputs) + 2 (q/k/v's input) + 2 (the MLP's input)
                                                + 2 m (the two residual dropouts' masks)
        split by t                              2 (q) + 4 k / a (k, v) + 2 (o's input)
                                                + 4 f / h (GELU: up's output, GELU's) or 6 f / h (SwiGLU: gate|up, product)
        scores, unfused kernel, split by t      (2 + 3 m) a s / h (the softmax; with dropout its mask and output)

    For GPT-3's shape (k = a, f = 4 h) with dropout this is their eq. 2, 34 + 5 a s / h; with tp, 10 + 24 / t +
    5 a s / (h t); with SP, (34 + 5 a s / h) / t. "selective" (and a fused flash kernel) drops the scores; "full"
    keeps the block's input, 2 / n."""
    s, b, h, a, t = fwd.seq, fwd.batch, spec.hidden, spec.heads, fwd.tp
    sbh, scale, m = s * b * h, fwd.e / 2, 1.0 if fwd.dropout > 0 else 0.0
    if recompute == "full":
        return 2 * sbh / fwd.n * scale
    if recompute == "op":
        return (2 * sbh / fwd.n + 2 * _operator_outputs(spec, fwd)) * scale
    replicated = 4 + 2 + 2 + 2 * m
    q = spec.q_width / h  # 1 unless the heads are not h / a wide
    split = 2 * q + 4 * spec.kv * spec.head_dim / h + 2 * q + (6 if spec.gated else 4) * spec.ffn / h
    scores = 0.0 if recompute == "selective" or fwd.attention == "flash" else (2 + 3 * m) * a * s / h
    return sbh * (replicated / fwd.n + (split + scores) / t) * scale


# ---------------------------------------------------------------------- both
def block_bytes(spec: ModelSpec, fwd: Forward, recompute: str = "none", accounting: str = "plait") -> float:
    """One block's saved activations for one micro-batch under ``accounting`` ("plait" or "korthikanti")."""
    if accounting == "plait":
        return plait_block_bytes(spec, fwd, recompute)
    if accounting == "korthikanti":
        return korthikanti_block_bytes(spec, fwd, recompute)
    raise ValueError(f"accounting={accounting!r} is unknown; use one of {ACCOUNTINGS}")


def ends_bytes(
    spec: ModelSpec,
    fwd: Forward,
    first: bool,
    last: bool,
    accounting: str = "plait",
    blocks_recomputed: bool = False,
) -> float:
    """Saved activations outside the blocks of a stage that holds the embeddings (``first``) and/or the head."""
    if accounting == "korthikanti":  # the fp32 logits of the last stage (their sec. 4.3)
        return 4 * fwd.seq * fwd.batch * spec.vocab / fwd.tp if last else 0.0
    first_bytes = plait_embedding_bytes(spec, fwd, blocks_recomputed) if first else 0.0
    return first_bytes + (plait_head_bytes(spec, fwd) if last else 0.0)


def loss_buffer_bytes(spec: ModelSpec, fwd: Forward) -> float:
    """Transient bytes when a micro-batch's backward begins on the last stage: the gradient of the fp32
    log-softmax and the gradient of its input (4 s b V / t each), besides the saved log-softmax; with chunked
    cross-entropy those of one chunk's tokens and its recomputed log-softmax (12 c' V / t, module docstring)."""
    if fwd.loss_chunk:
        return 12 * min(fwd.loss_chunk, fwd.seq * fwd.batch) * spec.vocab / fwd.tp
    return 8 * fwd.seq * fwd.batch * spec.vocab / fwd.tp


__all__ = [
    "ACCOUNTINGS",
    "ATTENTION_KERNELS",
    "Forward",
    "RESIDUAL_BYTES",
    "block_bytes",
    "core_internal_bytes",
    "ends_bytes",
    "korthikanti_block_bytes",
    "loss_buffer_bytes",
    "plait_block_bytes",
    "plait_embedding_bytes",
    "plait_head_bytes",
    "positions_bytes",
]
