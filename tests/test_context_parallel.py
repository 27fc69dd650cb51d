"""Context parallelism (plait.parallel.context): ring attention (zigzag) and Ulysses against full attention
(outputs and input gradients, causal and not, cp = 2 and 4, GQA), GPT training with cp=2 and dp=2 x cp=2
(and cp=4) against single-device training, bytes per layer against the formulas, saved activations per rank
falling as 1/cp, and clear errors for what cannot work."""

import contextlib
import dataclasses
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from helpers.composition import Combo, assert_combo_matches, reference_trajectory, train_combo
from helpers.harness import run_distributed
from helpers.reference import (
    Trajectory,
    assert_trajectories_match,
    masked_lm_batch,
    snapshot_grads,
    snapshot_params,
    train_reference,
)

import plait
from benchmarks.context_memory import gpt_saved_bytes, longest_sequence
from plait import Layout, LayoutError
from plait.comm import Comm
from plait.mesh import Mesh
from plait.models import GPT, GPTConfig
from plait.observe.memory import SavedActivations
from plait.parallel.context import RingAttention, SequenceSharding, UlyssesAttention, plan_context_parallel
from plait.parallel.context import ring as ring_module
from plait.parallel.context.traffic import measure_wire_bytes, theory_wire_bytes

BATCH, HEADS, LENGTH, HEAD_DIM = 2, 4, 16, 8
CORES = {"ring": RingAttention, "ulysses": UlyssesAttention}
ATTENTION_CASES = [(mode, causal, group) for mode in CORES for causal in (True, False) for group in (1, 2)]
"""(mode, causal, query heads per kv head): group 2 is grouped-query attention with 2 kv heads."""
FP32_ATTENTION_TOL = {"rtol": 1e-5, "atol": 2e-6}
"""Blockwise online softmax and the split of the key sum into blocks reorder fp32 sums: a few ulps of O(1) values."""


def _qkv(group: int, length: int = LENGTH) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full-sequence q [B, H, T, D] and k, v as the Attention layer hands them over (kv heads repeated)."""
    generator = torch.Generator().manual_seed(7 + group)
    q = torch.randn(BATCH, HEADS, length, HEAD_DIM, generator=generator)
    k, v = (
        torch.randn(BATCH, HEADS // group, length, HEAD_DIM, generator=generator).repeat_interleave(group, 1)
        for _ in range(2)
    )
    return q, k, v


def _kv_heads(grad: torch.Tensor, group: int) -> torch.Tensor:
    """Gradient of the distinct kv heads (what the Attention layer's repeat_interleave backward sums)."""
    return grad.view(grad.shape[0], -1, group, *grad.shape[2:]).sum(2)


@contextlib.contextmanager
def _recording_ring_events(comm: Comm) -> Iterator[list[str]]:
    """Record, in order, each ring hop posted ("post") and each block computed ("compute") in the forward."""
    events: list[str] = []
    real_send_recv, real_block_forward = comm.send_recv, ring_module.block_forward

    def send_recv(*args, **kwargs):
        events.append("post")
        return real_send_recv(*args, **kwargs)

    def block_forward(*args, **kwargs):
        events.append("compute")
        return real_block_forward(*args, **kwargs)

    comm.send_recv, ring_module.block_forward = send_recv, block_forward
    try:
        yield events
    finally:
        comm.send_recv, ring_module.block_forward = real_send_recv, real_block_forward


def _attention_on_rank(cp: int) -> dict:
    """Per case: this rank's output and input-gradient errors vs full attention, its bytes, its saved bytes."""
    mesh = Mesh.build(Layout(dp=1, cp=cp))
    comm = Comm(mesh)
    results = {}
    for mode, causal, group in ATTENTION_CASES:
        q, k, v = _qkv(group)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        reference = F.scaled_dot_product_attention(*full, is_causal=causal)
        weights = torch.randn(reference.shape, generator=torch.Generator().manual_seed(3))
        (reference * weights).sum().backward()
        sharding = SequenceSharding(mode, cp, mesh.index("cp"))
        index = sharding.local_positions(LENGTH)
        local = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
        core = CORES[mode](comm, sharding, kv_group=group, causal=causal)
        if mode == "ulysses" and (HEADS // group) % cp:  # 2 kv heads cannot split over 4 ranks
            with pytest.raises(ValueError, match=f"cp={cp}, but this layer has {HEADS} query and {HEADS // group}"):
                core(*local)
            continue
        before = comm.stats.snapshot()
        with SavedActivations() as saved, _recording_ring_events(comm) as events:
            out = core(*local)
        (out * weights[:, :, index]).sum().backward()
        traffic = comm.stats.since(before)
        errors = {"out": (out, reference[:, :, index])}
        errors["dq"] = (local[0].grad, full[0].grad[:, :, index])
        errors["dk"] = (_kv_heads(local[1].grad, group), _kv_heads(full[1].grad, group)[:, :, index])
        errors["dv"] = (_kv_heads(local[2].grad, group), _kv_heads(full[2].grad, group)[:, :, index])
        results[(mode, causal, group)] = {
            "close": {name: torch.allclose(a, e, **FP32_ATTENTION_TOL) for name, (a, e) in errors.items()},
            "worst": {name: float((a - e).detach().abs().max()) for name, (a, e) in errors.items()},
            "traffic": traffic.to_dict(),
            "saved": saved.bytes,
            "forward_events": events,
        }
    return results


def _uneven_length_on_rank(cp: int) -> dict:
    """T = 3 cp: a multiple of cp but not of 2 cp. Ulysses (contiguous T/cp = 3 tokens per rank) must equal full
    attention, causal and not, outputs and input gradients; ring (zigzag, 2 cp chunks) must refuse the length
    with a LayoutError naming the fix, raised by the sharding before any collective."""
    mesh = Mesh.build(Layout(dp=1, cp=cp))
    comm, length, results = Comm(mesh), 3 * cp, {}
    for causal in (True, False):
        q, k, v = _qkv(1, length)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        reference = F.scaled_dot_product_attention(*full, is_causal=causal)
        weights = torch.randn(reference.shape, generator=torch.Generator().manual_seed(3))
        (reference * weights).sum().backward()
        sharding = SequenceSharding("ulysses", cp, mesh.index("cp"))
        index = sharding.local_positions(length)
        local = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
        out = UlyssesAttention(comm, sharding, causal=causal)(*local)
        (out * weights[:, :, index]).sum().backward()
        pairs = [(out, reference[:, :, index])] + [(a.grad, e.grad[:, :, index]) for a, e in zip(local, full)]
        results[causal] = [float((a - e).detach().abs().max()) for a, e in pairs]
        results[f"close {causal}"] = all(torch.allclose(a, e, **FP32_ATTENTION_TOL) for a, e in pairs)
    with pytest.raises(LayoutError) as refused:
        SequenceSharding("ring", cp, mesh.index("cp")).local_positions(length)
    results["ring"] = str(refused.value)
    return results


@pytest.mark.distributed
@pytest.mark.parametrize("cp", [2, 4])
def test_ulysses_runs_lengths_that_are_not_multiples_of_2cp_and_ring_refuses_them(cp):
    for rank, result in enumerate(run_distributed(_uneven_length_on_rank, cp, cp)):
        for causal in (True, False):
            assert result[f"close {causal}"], (
                f"cp={cp} rank {rank} causal={causal}: worst |out, dq, dk, dv| errors {result[causal]}"
            )
        assert f"2*cp = {2 * cp} chunks" in result["ring"] and f"{3 * cp} tokens" in result["ring"], result["ring"]
        assert "Fix:" in result["ring"] and "pad the batch" in result["ring"], result["ring"]


def _theory_bytes(mode: str, cp: int, group: int) -> dict[str, float]:
    """Wire bytes one rank sends per attention layer and step (forward + backward) in fp32, and its calls, from
    the formulas of ``plait.parallel.context.traffic`` (checked by hand in ``test_wire_byte_formulas``)."""
    theory = theory_wire_bytes(mode, cp, BATCH, HEADS, HEADS // group, LENGTH, HEAD_DIM)
    key = "cp/send" if mode == "ring" else "cp/all_to_all"
    return {key: theory["forward"] + theory["backward"], "calls": theory["calls"]}


def test_wire_byte_formulas():
    """By hand for B=2, H=4, T=16, D=8, fp32. Ring, cp=2: block = 2*4*8*8 = 512 elements; forward one hop of
    (k, v) = 1024 x 4 B; backward that hop again plus one of the fp32 (dk, dv) accumulators. Ulysses, cp=2:
    each of the four all-to-alls per direction sends half of its [2, 8 tokens, 4 heads, 8] = 512-element input
    (1/2 x 512 x 4 B). cp=4: ring 3 hops of 2*4*4*8 = 256-element blocks; Ulysses 3/4 of 256-element inputs."""
    shape = (BATCH, HEADS, HEADS, LENGTH, HEAD_DIM)
    assert theory_wire_bytes("ring", 2, *shape) == {"forward": 4096, "backward": 8192, "calls": 3}
    assert theory_wire_bytes("ulysses", 2, *shape) == {"forward": 4 * 1024, "backward": 4 * 1024, "calls": 8}
    assert theory_wire_bytes("ring", 4, *shape) == {"forward": 3 * 2 * 256 * 4, "backward": 3 * 2 * 256 * 8, "calls": 9}
    assert theory_wire_bytes("ulysses", 4, *shape) == {"forward": 4 * 768, "backward": 4 * 768, "calls": 8}
    assert theory_wire_bytes("ring", 2, 2, 4, 2, 16, 8)["forward"] == 2048  # GQA: only the 2 kv heads travel


def _attention_and_traffic_on_rank(cp: int) -> tuple[dict, dict]:
    """``_attention_on_rank``, and the forward/backward split of one layer's bytes (``measure_wire_bytes``, what
    ``python -m benchmarks.context_memory`` prints for docs/context_parallel.md)."""
    comm = Comm(Mesh.build(Layout(dp=1, cp=cp)))
    split = {mode: measure_wire_bytes(comm, mode, BATCH, HEADS, HEADS, LENGTH, HEAD_DIM) for mode in CORES}
    return _attention_on_rank(cp), split


@pytest.fixture(scope="module")
def single_rank_saved() -> dict:
    """Saved bytes of each core run on the whole sequence by one rank (cp = 1), the 1/cp baseline."""
    return {case: result["saved"] for case, result in _attention_on_rank(1).items()}


@pytest.mark.distributed
@pytest.mark.parametrize("cp", [2, 4])
def test_attention_matches_full_attention_bytes_and_memory(cp, single_rank_saved):
    per_rank = run_distributed(_attention_and_traffic_on_rank, cp, cp)
    for rank, (results, split) in enumerate(per_rank):
        for mode, measured in split.items():  # forward and backward each equal their formula, to the byte
            assert measured == theory_wire_bytes(mode, cp, BATCH, HEADS, HEADS, LENGTH, HEAD_DIM), (cp, rank, mode)
        assert len(results) == len(ATTENTION_CASES) - (2 if cp == 4 else 0)  # Ulysses + GQA at cp=4: refused
        for (mode, causal, group), result in results.items():
            what = f"cp={cp} rank {rank} {mode} causal={causal} kv_group={group}"
            assert all(result["close"].values()), f"{what}: worst abs errors {result['worst']}"
            theory = _theory_bytes(mode, cp, group)
            key = "cp/send" if mode == "ring" else "cp/all_to_all"
            measured = result["traffic"][key]
            assert measured["wire_bytes"] == pytest.approx(theory[key], rel=1e-12), f"{what}: {result['traffic']}"
            assert measured["calls"] == theory["calls"], f"{what}: {result['traffic']}"
            if mode == "ring":  # each hop is posted before the block in hand is computed: transfer overlaps compute
                assert result["forward_events"] == ["post", "compute"] * (cp - 1) + ["compute"], what
            # Every tensor a core saves for backward is sequence-sharded (ring: q, k, v, o, lse of T/cp tokens)
            # or head-sharded (Ulysses: full-T attention for H/cp heads): exactly 1/cp of one rank's bytes.
            assert result["saved"] * cp == single_rank_saved[(mode, causal, group)], what


# ----------------------------------------------------------------- GPT training parity
STEPS, GLOBAL_BATCH, VOCAB = 5, 4, 32
ADAMW = lambda params: torch.optim.AdamW(params, lr=1e-3, eps=1e-5, weight_decay=0.1)  # noqa: E731
"""eps 1e-5, not 1e-8: some gradients here are ~1e-8..1e-7 by chance (mlp.down entries), and Adam's step
lr * g / (|g| + eps) has slope lr * eps / (|g| + eps)^2 there, which turns the ~1e-9 fp32 reordering noise of
blockwise attention in such a gradient into ~1e-6 parameter differences at eps 1e-6 (measured), above the fp32
tolerance. At eps 1e-5 the slope is at most lr / eps = 100: the comparison tests context parallelism, not
Adam's conditioning. Gradients themselves agree to ~2e-7 relative."""
GPT_CASES = {
    "cp2-ring-learned-recompute": (Layout(dp=1, cp=2, cp_mode="ring", recompute="full"), "learned", None),
    "cp2-ulysses-rope-gqa": (Layout(dp=1, cp=2, cp_mode="ulysses"), "rope", 2),
    "dp2cp2-ring-rope-gqa": (Layout(dp=2, cp=2, cp_mode="ring"), "rope", 2),
    "dp2cp2-ulysses-learned": (Layout(dp=2, cp=2, cp_mode="ulysses"), "learned", None),
    "cp4-ring-rope": (Layout(dp=1, cp=4, cp_mode="ring"), "rope", None),
    "cp4-ulysses-learned": (Layout(dp=1, cp=4, cp_mode="ulysses"), "learned", None),
}
"""name -> (layout, position embedding, n_kv_head)."""


def make_gpt(position: str, kv_heads: int | None) -> GPT:
    torch.manual_seed(1234)
    config = GPTConfig(
        vocab_size=VOCAB,
        seq_len=LENGTH,
        n_layer=2,
        n_head=HEADS,
        n_kv_head=kv_heads,
        d_model=32,
        position=position,
        bias=False,
    )  # no bias: see docs/testing.md
    return GPT(config)


def global_batch(step: int, length: int = LENGTH) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens with ignored targets (``reference.masked_lm_batch``): cp ranks score different numbers
    of tokens, dp ranks equal numbers."""
    return masked_lm_batch(100 + step, GLOBAL_BATCH, length, VOCAB)


def _train_on_rank(names: list[str]) -> dict:
    world = torch.distributed.get_world_size()
    results = {
        f"memory-cp{world}": {mode: gpt_saved_bytes(world, mode, MEMORY_LENGTHS) for mode in CORES},
        f"longest-cp{world}": {mode: longest_sequence(world, mode, MEMORY_LIMIT) for mode in CORES},
    }
    for name in names:
        layout, position, kv_heads = GPT_CASES[name]
        if layout.world_size != torch.distributed.get_world_size():
            continue
        model = make_gpt(position, kv_heads)
        engine = plait.parallelize(model, layout, optimizer=ADAMW)
        dp_index, dp = engine.mesh.index("dp"), engine.mesh.size("dp")
        trajectory, traffic = Trajectory(), []
        engine.before_optimizer_step.append(lambda e: trajectory.grads.append(snapshot_grads(e.model)))  # noqa: B023 - called within this iteration
        for step in range(STEPS):
            inputs, targets = global_batch(step)
            rows = slice(dp_index * GLOBAL_BATCH // dp, (dp_index + 1) * GLOBAL_BATCH // dp)
            stats = engine.train_step((inputs[rows], targets[rows]))
            trajectory.losses.append(stats.loss)
            trajectory.params.append(snapshot_params(engine.model))
            traffic.append(stats.comm.to_dict())
        # every rank evaluates the whole batch; the metric counts rows, so the total is GLOBAL_BATCH x dp (not x cp)
        evaluation = engine.evaluate([global_batch(STEPS)], metric=lambda output, target: (0, target.shape[0]))
        with pytest.raises(LayoutError) as bad_length:  # raised in the forward pre-hook, before any collective
            engine.train_step(global_batch(0, length=LENGTH - 3))
        results[name] = {
            "trajectory": trajectory,
            "traffic": traffic,
            "eval": evaluation.loss,
            "eval_total": evaluation.total,
            "bad_length": str(bad_length.value),
        }
        uneven = [global_batch(STEPS, length=LENGTH - layout.cp)]  # a multiple of cp, not of 2 cp
        if layout.cp_mode == "ulysses":
            results[name]["eval_uneven"] = engine.evaluate(uneven).loss
        else:
            with pytest.raises(LayoutError) as refused:
                engine.evaluate(uneven)
            results[name]["eval_uneven"] = str(refused.value)
    return results


def _step_theory(layout: Layout, kv_heads: int | None) -> tuple[str, float]:
    """Wire bytes on the cp axis per training step: the per-layer formula x 2 layers (x 1 micro-batch of
    GLOBAL_BATCH/dp rows), plus, under full recomputation, the ring's forward hops once more in backward."""
    group = HEADS // (kv_heads or HEADS)
    per_layer = _theory_bytes(layout.cp_mode, layout.cp, group)
    key = "cp/send" if layout.cp_mode == "ring" else "cp/all_to_all"
    rows_factor = (GLOBAL_BATCH // layout.dp) / BATCH
    total = 2 * per_layer[key] * rows_factor
    if layout.recompute == "full" and layout.cp_mode == "ring":
        total *= 4 / 3  # forward hops (1/3 of a layer's bytes) are replayed by the recomputation
    return key, total


@pytest.fixture(scope="module")
def gpt_runs() -> dict:
    names = list(GPT_CASES)
    results = {}
    for world in (2, 4):
        for per_rank in zip(*(r.items() for r in run_distributed(_train_on_rank, world, names, timeout=240))):
            name = per_rank[0][0]
            results[name] = [value for _, value in per_rank]
    return results


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(GPT_CASES))
def test_gpt_training_matches_single_device(name, gpt_runs):
    layout, position, kv_heads = GPT_CASES[name]
    expected = train_reference(make_gpt(position, kv_heads), [global_batch(s) for s in range(STEPS)], ADAMW)
    reference_model = make_gpt(position, kv_heads)
    for rank, result in enumerate(gpt_runs[name]):
        try:
            assert_trajectories_match(result["trajectory"], expected)
        except AssertionError as error:
            raise AssertionError(f"{name} rank {rank}: {error}") from error
        assert result["trajectory"].losses == gpt_runs[name][0]["trajectory"].losses, f"{name}: rank {rank} differs"
        key, theory = _step_theory(layout, kv_heads)
        for step, traffic in enumerate(result["traffic"]):
            assert traffic[key]["wire_bytes"] == pytest.approx(theory, rel=1e-12), f"{name} step {step}: {traffic}"
        assert "multiple of" in result["bad_length"] and str(LENGTH - 3) in result["bad_length"], result["bad_length"]
    # Evaluation gathers the full sequence: its loss is the trained model's loss on the whole batch.
    model = train_reference_model(reference_model, expected)
    inputs, targets = global_batch(STEPS)
    with torch.no_grad():
        full_loss = float(F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()))
    inputs, targets = global_batch(STEPS, length=LENGTH - layout.cp)
    with torch.no_grad():
        uneven_loss = float(F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()))
    for result in gpt_runs[name]:
        assert result["eval"] == pytest.approx(full_loss, rel=1e-5), f"{name}: eval {result['eval']} != {full_loss}"
        if layout.cp_mode == "ulysses":  # T = 16 - cp is a multiple of cp but not of 2 cp: Ulysses runs it
            assert result["eval_uneven"] == pytest.approx(uneven_loss, rel=1e-5), (name, result["eval_uneven"])
        else:  # ... and the zigzag ring refuses it, naming the fix
            assert f"2*cp = {2 * layout.cp} chunks" in result["eval_uneven"] and "Fix:" in result["eval_uneven"]
        assert result["eval_total"] == GLOBAL_BATCH * layout.dp, f"{name}: samples counted once per dp rank, not per cp"


def train_reference_model(model: GPT, trajectory: Trajectory) -> GPT:
    """``model`` with the reference trajectory's final parameters."""
    model.load_state_dict(trajectory.params[-1])
    return model


MEMORY_LENGTHS = [32, 64]
MEMORY_LIMIT = 2**18
"""Per-rank saved-activation budget of the longest-sequence test: ~59 tokens on one device for measure's GPT."""


@pytest.mark.distributed
@pytest.mark.parametrize("cp", [2, 4])
def test_gpt_saved_activations_per_rank_fall_as_one_over_cp(cp, gpt_runs):
    """Bytes autograd keeps for backward in a whole GPT forward (measure.gpt_saved_bytes: 2 layers, d=32, batch 1).

    Ring: exactly 1/cp of one device (every saved tensor has T/cp tokens; the core's o is laid out so that the
    output projection saves the same storage). Ulysses: 1/cp plus one B x T/cp x d fp32 tensor per layer: the
    attention kernel keeps its full-T output for H/cp heads and the output projection its T/cp x H input, two
    layouts of the same values that one device stores once."""
    single = gpt_saved_bytes(1, "ring", MEMORY_LENGTHS)
    d_model, layers = 32, 2
    for rank, measured in enumerate(gpt_runs[f"memory-cp{cp}"]):
        for length, whole, ring, ulysses in zip(MEMORY_LENGTHS, single, measured["ring"], measured["ulysses"]):
            assert ring * cp == whole, (cp, rank, length, ring, whole)
            assert ulysses == whole // cp + layers * (length // cp) * d_model * 4, (cp, rank, length, ulysses, whole)


# ----------------------------------------------------------------- errors (pure, no processes)
def test_sequence_lengths_that_do_not_split_are_refused_with_the_fix():
    with pytest.raises(LayoutError, match=r"2\*cp = 8 chunks .* 12 tokens.*multiple of 8"):
        SequenceSharding("ring", 4, 0).check_length(12)
    with pytest.raises(LayoutError, match=r"cp = 4 pieces.* 10 tokens.*multiple of 4"):
        SequenceSharding("ulysses", 4, 1).local_positions(10)
    assert SequenceSharding("ulysses", 4, 1).local_positions(12).tolist() == [3, 4, 5]


def test_zigzag_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r():
    sharding = SequenceSharding("ring", 4, 1)
    assert sharding.local_positions(16).tolist() == [2, 3, 12, 13]
    assert sorted(sharding.gathered_order(16).tolist()) == list(range(16))
    # equal work: every block other than the own one is c x 2c query-key pairs, none fully masked
    for source in range(4):
        pieces = sharding.pieces(source, 4, causal=True)
        assert len(pieces) == 1
        area = (pieces[0].q_rows.stop - pieces[0].q_rows.start) * (pieces[0].kv_rows.stop - pieces[0].kv_rows.start)
        assert area == (16 if source == 1 else 8), (source, pieces)


def test_heads_not_divisible_for_ulysses_name_the_numbers_and_the_fix():
    model = make_gpt("rope", 2)
    with pytest.raises(LayoutError, match=r"4 query and 2 key/value heads.*tp\*cp = 1\*4 = 4.*cp_mode='ring'"):
        plan_context_parallel(model, Layout(dp=1, cp=4, cp_mode="ulysses"))
    with pytest.raises(LayoutError, match=r"tp\*cp = 2\*2 = 4"):
        plan_context_parallel(model, Layout(dp=1, tp=2, cp=2, cp_mode="ulysses"))
    assert plan_context_parallel(model, Layout(dp=1, cp=4, cp_mode="ring")).attention_paths[0] == "blocks.0.attn"
    assert plan_context_parallel(model, Layout(dp=1, cp=2, cp_mode="ulysses")).size == 2


def test_models_context_parallel_cannot_handle_are_refused():
    with pytest.raises(LayoutError, match="no 'positions' argument"):
        plan_context_parallel(torch.nn.Sequential(make_gpt("rope", None)), Layout(dp=1, cp=2))
    with pytest.raises(LayoutError, match="has none"):
        plan_context_parallel(torch.nn.Linear(2, 2), Layout(dp=1, cp=2))
    with pytest.raises(LayoutError, match="schedule='pipedream' is not implemented"):  # pp x cp: synchronous only
        plan_context_parallel(make_gpt("rope", None), Layout(dp=1, cp=2, pp=2, schedule="pipedream"))
    torch.manual_seed(0)
    dropout = GPT(GPTConfig(vocab_size=VOCAB, seq_len=LENGTH, n_layer=1, n_head=2, d_model=16, dropout=0.1))
    with pytest.raises(LayoutError, match="dropout=0.1"):
        plan_context_parallel(dropout, Layout(dp=1, cp=2))


@pytest.mark.distributed
@pytest.mark.parametrize("cp", [2, 4])
def test_longest_sequence_within_a_memory_limit_grows_as_cp(cp, gpt_runs):
    """measure.longest_sequence: the answer T fits the per-rank limit and T + one split unit does not (both
    measured). Ring saves exactly 1/cp per rank, so its T is cp times one device's, less the rounding to a
    multiple of 2cp; Ulysses saves (4440 + 2*32*4) / 4440 ~ 1.06 times more per token than 1/cp (the extra
    B x T/cp x d tensor per layer), so its T is at least 0.9 cp times one device's."""
    single, _, _ = longest_sequence(1, "ring", MEMORY_LIMIT)
    for rank, longest in enumerate(gpt_runs[f"longest-cp{cp}"]):
        for mode, (length, fits, over) in longest.items():
            assert fits <= MEMORY_LIMIT < over, (cp, rank, mode, length, fits, over)
        assert cp * single - 2 * cp < longest["ring"][0] <= cp * single + 2 * cp, (cp, single, longest)
        assert 0.9 * cp * single < longest["ulysses"][0] < longest["ring"][0], (cp, single, longest)


# ----------------------------------------------------------------- cp with Megatron-SP (tp=2, cp=2)
@dataclasses.dataclass(frozen=True)
class SequenceParallelCombo(Combo):
    """A cell of the composition matrix (tests/composition.py) with Megatron sequence parallelism switched on."""

    def layout(self) -> Layout:
        return dataclasses.replace(super().layout(), sequence_parallel=True)


def _train_with_sequence_parallel(modes: list[str]) -> dict:
    """Each mode's composition-matrix run (3 steps, clipping, the evaluation loss) under tp=2 x cp=2 with SP, the
    tp collectives it used, and the LayoutError for a length whose T/cp tokens SP cannot split."""
    results, built = {}, []
    real_parallelize = plait.parallelize
    with mock.patch.object(plait, "parallelize", lambda *a, **k: built.append(real_parallelize(*a, **k)) or built[-1]):
        for mode in modes:
            results[mode] = train_combo(SequenceParallelCombo(dp=1, tp=2, pp=1, cp=2, zero=0, cp_mode=mode))
            results[mode]["tp ops"] = sorted(key for key in built[-1].comm.stats.to_dict() if key.startswith("tp/"))
    with pytest.raises(LayoutError) as refused:  # Ulysses takes T=6 (3 tokens per cp rank), SP cannot split 3
        built[-1].model(torch.zeros(1, 6, dtype=torch.long))
    results["refused"] = str(refused.value)
    return results


@pytest.mark.distributed
def test_context_parallel_with_megatron_sequence_parallel_matches_single_device():
    """cp cuts the sequence first (T/cp tokens per rank at their global positions), SP cuts those over tp (norms,
    residuals: T/(cp tp) tokens), attention gathers them back over tp and runs ring/Ulysses over cp."""
    modes = ["ring", "ulysses"]
    per_rank = run_distributed(_train_with_sequence_parallel, 4, modes, timeout=300)
    expected = reference_trajectory()
    for mode in modes:
        assert_combo_matches(SequenceParallelCombo(1, 2, 1, 2, 0, mode), [r[mode] for r in per_rank], expected)
        for result in per_rank:  # SP's reduce-scatter / all-gather along the sequence, not plain tp's all-reduce
            assert "tp/reduce_scatter" in result[mode]["tp ops"], result[mode]["tp ops"]
    for result in per_rank:
        assert "Megatron-SP cannot split over tp=2" in result["refused"] and "multiple of 4" in result["refused"]
