"""Packed documents (issue 27): a window of several documents, with positions that restart at each one
(``plait.models.inputs``), gives the per-token losses and the gradients of its documents run one by one, each as
its own sequence, under every layout: dp with ZeRO-3, tp with Megatron-SP, pp (1F1B, two micro-batches), cp ring
(zigzag, fully masked blocks skipped and counted) and Ulysses, for plait's GPT (RoPE with grouped-query attention,
and learned positions) and Hugging Face Llama / GPT-2 (``position_ids``). Larger layouts (pp x cp, tp x cp, dp x
cp) run under ``long``. The ring's skip decisions are checked against the brute-force mask in one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.composition import whole_gradients
from helpers.harness import run_distributed

import plait
from plait import Layout
from plait.models import GPT, GPTConfig
from plait.models.layers import document_mask
from plait.parallel.context.documents import TILE, BlockCounts, DocumentRing
from plait.parallel.context.ring import RingAttention
from plait.parallel.context.sharding import SequenceSharding

VOCAB, SEQ, ROWS = 32, 16, 4
DOCUMENTS = [[5, 7, 4], [16], [4, 4, 8], [1, 3, 12]]
"""Each row's document lengths (a window of SEQ tokens): a row of one document, a one-token document, documents
on the cp=2 ring's chunk edges (multiples of 4) and across them."""
STEPS = 2
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-6}
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-6}


def positions_of(lengths: list[list[int]]) -> torch.Tensor:
    """[rows, T]: 0, 1, ... within each document."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])


def packed_batch(step: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """((tokens, positions), targets) of ``ROWS`` windows; a few targets ignored (-100)."""
    generator = torch.Generator().manual_seed(7 + step)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=generator)
    targets = tokens[:, 1:].clone()
    targets[torch.rand(ROWS, SEQ, generator=generator) < 0.15] = -100
    return (tokens[:, :-1].contiguous(), positions_of(DOCUMENTS)), targets


def pieces() -> list[tuple[int, int, int]]:
    """(row, start, end) of every document of the batch."""
    out = []
    for row, lengths in enumerate(DOCUMENTS):
        start = 0
        for length in lengths:
            out.append((row, start, start + length))
            start += length
    return out


def make_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(99)
    if kind == "rope":
        return GPT(GPTConfig.llama_style(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=4, n_kv_head=2, d_model=16))
    if kind == "learned":
        return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=4, d_model=16, bias=False))
    from helpers.hf import make_model as hf_model

    return (
        hf_model(kind, hidden_size=16, num_attention_heads=2, num_key_value_heads=2)
        if kind == "llama"
        else (hf_model(kind, n_embd=16, n_head=2))
    )


def optimizer(params):  # noqa: ANN001, ANN201 - a factory
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-5)


def logits_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


def one_by_one(model: torch.nn.Module, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token losses [rows, T] (0 where ignored) of every document run alone, and their token mean."""
    (tokens, _), targets = packed_batch(step)
    losses = torch.zeros(ROWS, SEQ)
    for row, start, end in pieces():
        logits = logits_of(model, tokens[row : row + 1, start:end])[0]
        losses[row, start:end] = F.cross_entropy(logits.float(), targets[row, start:end], reduction="none")
    return losses, losses.sum() / (targets != -100).sum()


def reference(kind: str) -> dict:
    """One device, documents one by one: per-token losses before training, losses and step-0 gradients."""
    model = make_model(kind)
    with torch.no_grad():
        tokens_losses, _ = one_by_one(model.eval(), 0)
    model.train()
    opt = optimizer(model.parameters())
    losses, grads = [], {}
    for step in range(STEPS):
        _, loss = one_by_one(model, step)
        loss.backward()
        losses.append(float(loss.detach()))
        if step == 0:
            grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    return {"token_losses": tokens_losses, "losses": losses, "grads": grads}


def per_token(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)


def run_layout(kind: str, layout: Layout) -> dict:
    """This rank's view of one layout: per-token losses of the eval forward (None where the output is not held),
    the step losses, the whole step-0 gradients, the ring's block counts."""
    engine = plait.parallelize(make_model(kind), layout, optimizer=optimizer)
    dp_rank, dp = engine.mesh.index("dp"), engine.mesh.size("dp")
    share = slice(dp_rank * ROWS // dp, (dp_rank + 1) * ROWS // dp)
    (tokens, positions), targets = packed_batch(0)
    engine.model.eval()
    with torch.no_grad():
        logits = engine.runner.forward((tokens[share], positions[share]))
    engine.model.train()
    token_losses = None if logits is None else per_token(logits, targets[share])
    whole = whole_gradients
    if kind in ("llama", "gpt2"):  # fused or transposed slices (GPT-2's c_attn): the HF helpers gather them
        from helpers.hf import gather_grads as whole
    grads: list[dict[str, torch.Tensor]] = []
    engine.before_optimizer_step.append(lambda e: grads.append(whole(e)) if not grads else None)
    cores = [m for m in engine.model.modules() if isinstance(m, RingAttention)]  # plait's and HF models'
    for core in cores:
        core.counts.reset()
    losses = []
    for step in range(STEPS):
        (tokens, positions), targets = packed_batch(step)
        losses.append(engine.train_step(((tokens[share], positions[share]), targets[share])).loss)
    counts = BlockCounts()
    for core in cores:
        counts.computed += core.counts.computed
        counts.skipped += core.counts.skipped
    return {"token_losses": token_losses, "share": share, "losses": losses, "grads": grads[0], "counts": counts}


def run_layouts(cases: list[tuple[str, Layout]]) -> list[dict]:
    return [run_layout(kind, layout) for kind, layout in cases]


def check(cases: list[tuple[str, Layout]], per_rank: list[list[dict]]) -> None:
    references: dict[str, dict] = {}
    for index, (kind, layout) in enumerate(cases):
        what = f"{kind} {layout.short()}"
        expected = references.setdefault(kind, reference(kind))
        results = [rank[index] for rank in per_rank]
        for rank, result in enumerate(results):
            assert result["losses"] == results[0]["losses"], f"{what}: rank {rank} reports another loss"
            if result["token_losses"] is not None:
                torch.testing.assert_close(
                    result["token_losses"],
                    expected["token_losses"][result["share"]],
                    **LOSS_TOL,
                    msg=lambda m, rank=rank, what=what: f"{what} rank {rank} per-token losses: {m}",
                )
        assert any(r["token_losses"] is not None for r in results), f"{what}: no rank holds the output"
        torch.testing.assert_close(
            torch.tensor(results[0]["losses"]), torch.tensor(expected["losses"]), **LOSS_TOL, msg=what
        )
        grads: dict[str, torch.Tensor] = {}
        for result in results:
            grads.update(result["grads"])
        assert grads.keys() == expected["grads"].keys(), f"{what}: {sorted(grads.keys() ^ expected['grads'].keys())}"
        for name, grad in grads.items():
            torch.testing.assert_close(
                grad, expected["grads"][name], **GRAD_TOL, msg=lambda m, n=name, w=what: f"{w} {n}: {m}"
            )


TWO_RANKS = [
    ("rope", Layout(dp=2, zero=3)),
    ("rope", Layout(tp=2, sequence_parallel=True)),
    ("learned", Layout(pp=2, microbatches=2, schedule="1f1b")),
    ("rope", Layout(cp=2, cp_mode="ring", microbatches=ROWS)),
    ("learned", Layout(cp=2, cp_mode="ulysses")),
    ("llama", Layout(cp=2, cp_mode="ring")),
    ("gpt2", Layout(cp=2, cp_mode="ulysses")),
    ("llama", Layout(pp=2, microbatches=2, schedule="gpipe")),
    ("gpt2", Layout(tp=2)),
]
FOUR_RANKS = [
    ("rope", Layout(pp=2, cp=2, microbatches=2, schedule="1f1b", cp_mode="ring")),
    ("learned", Layout(tp=2, cp=2, sequence_parallel=True, cp_mode="ring")),
    ("rope", Layout(dp=2, cp=2, zero=1, cp_mode="ulysses")),
    ("llama", Layout(tp=2, cp=2, cp_mode="ring")),
]


@pytest.mark.distributed
def test_packed_documents_equal_documents_one_by_one_on_two_ranks() -> None:
    pytest.importorskip("transformers")
    per_rank = run_distributed(run_layouts, 2, TWO_RANKS, timeout=300)
    check(TWO_RANKS, per_rank)
    # one row per micro-batch (a piece is skipped when every row of the micro-batch hides it), 2 layers, forwards
    ring = [rank[3]["counts"] for rank in per_rank]
    assert TWO_RANKS[3][1].cp_mode == "ring" and TWO_RANKS[3][1].microbatches == ROWS
    assert sum(c.skipped for c in ring) == STEPS * 2 * row_skips(2) > 0, ring


@pytest.mark.distributed
@pytest.mark.long
def test_packed_documents_equal_documents_one_by_one_on_four_ranks() -> None:
    pytest.importorskip("transformers")
    per_rank = run_distributed(run_layouts, 4, FOUR_RANKS, timeout=600)
    check(FOUR_RANKS, per_rank)


def tiles_of(piece_rows: slice, local: int, tile: int) -> list[slice]:
    """A piece's query rows cut into tiles of at most ``tile`` rows, never across the rank's two chunks."""
    half, out = local // 2, []
    for low, high in ((0, half), (half, local)):
        start = max(low, piece_rows.start)
        while start < min(high, piece_rows.stop):
            out.append(slice(start, min(start + tile, high)))
            start = out[-1].stop
    return out


def expected_skips(cp: int, rows: slice = slice(None), tile: int = TILE) -> int:
    """Tiles of the zigzag pieces that no query of ``rows`` sees any key of (brute force over the whole window's
    mask), summed over the cp ranks."""
    full = document_mask(positions_of(DOCUMENTS)[rows])[:, 0]  # [B, T, T]
    skipped = 0
    for rank in range(cp):
        sharding = SequenceSharding("ring", cp, rank)
        queries = sharding.local_positions(SEQ)
        for source in range(cp):
            keys = sharding.local_positions(SEQ, source)
            for piece in sharding.pieces(source, SEQ // cp, causal=True):
                for part in tiles_of(piece.q_rows, SEQ // cp, tile):
                    skipped += not bool(full[:, queries[part]][:, :, keys[piece.kv_rows]].any())
    return skipped


def random_documents(generator: torch.Generator, rows: int = 2) -> list[list[int]]:
    lengths = []
    for _ in range(rows):
        row, left = [], SEQ
        while left:
            row.append(int(torch.randint(1, min(left, 6) + 1, (1,), generator=generator)))
            left -= row[-1]
        lengths.append(row)
    return lengths


@pytest.mark.parametrize("cp, tile", [(2, 2), (2, 3), (2, TILE), (4, 1), (4, TILE)])
def test_ring_computes_every_visible_key_skips_empty_tiles_and_masks_only_where_needed(cp: int, tile: int) -> None:
    """DocumentRing's tiles from one rank's own positions against the whole window's mask: every key a query sees
    is in a computed tile, a skipped tile hides every key of its piece from its queries, an unmasked tile's
    queries see all of its keys, and a tile's mask is the window's mask there."""
    generator = torch.Generator().manual_seed(cp * 10 + tile)
    for trial in range(20):
        lengths = random_documents(generator)
        positions = positions_of(lengths)
        full = document_mask(positions)[:, 0]
        for rank in range(cp):
            sharding = SequenceSharding("ring", cp, rank)
            queries = sharding.local_positions(SEQ)
            ring = DocumentRing(sharding, positions[:, queries], tile=tile)
            for source in range(cp):
                keys = sharding.local_positions(SEQ, source)
                counts = BlockCounts()
                kept = ring.pieces(source, counts)
                covered = torch.zeros(2, SEQ // cp, SEQ // cp, dtype=torch.bool)
                for part in kept:
                    rows, cols = part.piece.q_rows, part.piece.kv_rows
                    block = full[:, queries[rows]][:, :, keys[cols]]
                    assert part.masked == (not bool(block.all())), (trial, rank, source, lengths)
                    assert torch.equal(ring.mask(source, part.piece)[:, 0], block)
                    covered[:, rows, cols] = True
                visible = full[:, queries][:, :, keys]
                assert bool((covered | ~visible).all()), (trial, rank, source, lengths)  # nothing seen is left out
                pieces = sharding.pieces(source, SEQ // cp, causal=True)
                tiles = sum(len(tiles_of(piece.q_rows, SEQ // cp, tile)) for piece in pieces)
                assert counts.computed + counts.skipped == tiles and counts.computed == len(kept)


def row_skips(cp: int) -> int:
    """``expected_skips`` of each row alone, summed."""
    return sum(expected_skips(cp, slice(row, row + 1)) for row in range(ROWS))


def test_the_training_batch_skips_blocks() -> None:
    """The batch of the two-rank test: rows whose documents hide tiles (what its skip count checks), and one
    row of one document (a micro-batch holding it skips nothing)."""
    assert row_skips(2) == 6 and row_skips(4) > row_skips(2)
    assert expected_skips(2) == 0


def test_one_document_per_row_is_plain_causal_attention_bitwise() -> None:
    model = make_model("rope").eval()
    tokens = packed_batch(0)[0][0]
    whole = torch.arange(SEQ).expand(ROWS, SEQ)
    assert torch.equal(model(tokens, whole), model(tokens))
    # a row whose window starts inside a document (positions from k > 0): still causal over the whole window
    assert torch.equal(model(tokens[:, 1:], whole[:, 1:]), model(tokens[:, 1:], torch.arange(1, SEQ)))


# ----------------------------------------------------------------- the data: positions from the folder's offsets
@pytest.fixture(scope="module")
def folder(tmp_path_factory):  # noqa: ANN001, ANN201
    """A bytes folder of 30 documents of uneven lengths (4 to 40 bytes, each + eos), 20% held out."""
    import json

    from plait.data import prepare

    root = tmp_path_factory.mktemp("documents")
    texts = [("abcdefghij" * 5)[: 3 + (7 * i) % 38] for i in range(30)]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    prepare([root / "docs.jsonl"], root / "out", val_fraction=0.2, progress=False)
    return root / "out"


@pytest.mark.parametrize("split", ["train", "val"])
def test_token_windows_carry_positions_that_restart_at_each_document(folder, split) -> None:  # noqa: ANN001
    import numpy as np

    from plait.data import TokenDataset

    train = TokenDataset(folder, seq_len=24, seed=5, attention="document", eod_mask_loss=True)
    dataset = train if split == "train" else train.validation_split()
    assert dataset is not None and dataset.attention == "document" and dataset.eod_mask_loss
    causal = TokenDataset(folder, seq_len=24, seed=dataset.seed, split=split)
    stream = np.asarray(dataset.data).astype(np.int64)
    starts = set(np.asarray(dataset.folder.offsets(split)).tolist())
    indices = list(range(min(12, dataset.num_windows)))
    (tokens, positions), targets = dataset.batch(indices)
    plain_tokens, plain_targets = causal.batch(indices)
    assert torch.equal(tokens, plain_tokens) and positions.dtype == torch.long and positions.shape == tokens.shape
    restarts = 0
    for row, window in enumerate(dataset.windows(indices).tolist()):
        first = window * 24
        for t in range(24):
            begins = t == 0 or first + t in starts
            expected = 0 if begins else int(positions[row, t - 1]) + 1
            assert int(positions[row, t]) == expected, (row, t)
            restarts += begins and t > 0
            # the target after each end-of-document token (the next document's first token) scores nothing
            ends = stream[first + t] == dataset.eos_id
            assert int(targets[row, t]) == (-100 if ends else int(plain_targets[row, t])), (row, t)
    assert restarts > (5 if split == "train" else 2)  # the windows do hold several documents


def test_hostile_document_offsets_are_refused(folder, tmp_path) -> None:  # noqa: ANN001
    import json
    import shutil

    import numpy as np

    from plait.data import TokenDataset
    from plait.data.sources import sha256_of
    from plait.errors import DataError

    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    offsets = np.fromfile(copy / "train.idx", dtype="<i8")
    offsets[3], offsets[4] = offsets[4], offsets[3]  # out of order: positions would go negative
    offsets.tofile(copy / "train.idx")
    meta = json.loads((copy / "meta.json").read_text())  # a hostile folder whose checksums agree with it
    meta["files"]["train.idx"]["sha256"] = sha256_of(copy / "train.idx")
    (copy / "meta.json").write_text(json.dumps(meta))
    TokenDataset(copy, seq_len=8, attention="causal")  # only documents read the offsets
    with pytest.raises(DataError, match="document offsets .* corrupt"):
        TokenDataset(copy, seq_len=8, attention="document")
    with pytest.raises(DataError, match="document offsets .* corrupt"):
        TokenDataset(copy, seq_len=8, eod_mask_loss=True)


def test_a_layout_cutting_the_batch_inside_the_model_is_refused_in_one_line() -> None:
    """2D/2.5D/3D tensor parallelism cuts the batch inside the model: the positions' rows no longer match."""
    from plait.models.layers import ScaledDotProductAttention

    q = torch.randn(2, 4, SEQ, 8)
    positions = positions_of(DOCUMENTS)  # 4 rows
    with pytest.raises(ValueError, match=r"hold 4 rows, but attention sees 2.*Fix: tp_mode='1d'"):
        ScaledDotProductAttention()(q, q, q, positions=positions)
