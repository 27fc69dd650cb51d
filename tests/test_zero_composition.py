"""ZeRO-2/3 composed with pipeline and tensor parallelism, against single-device training.

- ZeRO-2 x pp (GPipe, 1F1B): every micro-batch's backward runs in ``no_sync``; full gradients accumulate and
  each bucket is reduce-scattered once, in ``finish_backward``.
- ZeRO-3 x pp with interleaved chunks (v=2 model chunks per rank) and zero-bubble (split I / W backward): each
  stage's units are gathered around every action and freed after (``plait.parallel.zero.fsdp_pipeline``); we
  check that between steps only the shards are held, that the units were gathered once per action (activation
  recomputation included: the block re-runs inside its backward's gather) and one block at a time in F and B.
- ZeRO-3 x tp with Megatron sequence parallelism (norm weights get tp-partial gradients, summed over tp on the
  shard pieces), and dp2 x tp2 x pp2 x ZeRO-3 all together (8 ranks).
- Hugging Face models: Llama with dp2 x tp2 x ZeRO-3; GPT-2 (embeddings tied across the first and the last
  pipeline stage) with dp2 x pp2 x ZeRO-2.
- Refusals (no processes): ZeRO-3 with tied embeddings across pipeline stages, ZeRO-3 with 2D tensor
  parallelism, PipeDream with ZeRO-2.

The GPT cases reuse the composition matrix's model, data, optimizer, tolerances and checks (tests/composition.py:
3 AdamW steps with global-norm clipping that acts at every step).
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from helpers.composition import (
    CLIP,
    GLOBAL_BATCH,
    STEPS,
    Combo,
    assert_combo_matches,
    check_in_one_process,
    make_model,
    optimizer,
    reference_trajectory,
    whole_gradients,
    whole_parameters,
)
from helpers.harness import run_distributed

import plait
from plait import Layout, LayoutError
from plait.data import ShardedBatches
from plait.models import GPT, GPTConfig
from plait.parallel.zero.fsdp import FullyShardedStrategy
from plait.parallel.zero.fsdp_unit import UnitState

GPT_CASES: dict[str, dict] = {
    "dp2-pp2-zero2-gpipe": dict(dp=2, pp=2, zero=2, microbatches=2, schedule="gpipe"),
    "dp2-pp2-zero2-1f1b": dict(dp=2, pp=2, zero=2, microbatches=4, schedule="1f1b"),
    "dp2-pp2-zero3-interleaved": dict(dp=2, pp=2, zero=3, microbatches=2, schedule="interleaved", virtual_stages=2),
    "dp2-pp2-zero3-zero-bubble": dict(dp=2, pp=2, zero=3, microbatches=2, schedule="zero-bubble"),
    "dp2-pp2-zero3-1f1b-recompute": dict(dp=2, pp=2, zero=3, microbatches=2, schedule="1f1b", recompute="full"),
    "dp2-tp2-sp-zero3": dict(dp=2, tp=2, zero=3, sequence_parallel=True),
}
"""World-4 GPT cases (one process start-up for all)."""
ALL_AXES = dict(dp=2, tp=2, pp=2, zero=3, microbatches=2, schedule="1f1b")
"""dp2 x tp2 x pp2 x ZeRO-3: 8 ranks."""


def _combo(layout: Layout) -> Combo:
    return Combo(layout.dp, layout.tp, layout.pp, layout.cp, layout.zero)


def _train_gpt(layout: Layout) -> dict:
    """composition.train_combo for any layout, plus ZeRO-3's bookkeeping: the gathers of the last step by kind of
    action, and whether only the shards are held after it."""
    model, task = make_model()
    engine = plait.parallelize(model, layout, optimizer=optimizer, max_grad_norm=CLIP)
    grads: list[dict[str, torch.Tensor]] = []
    engine.before_optimizer_step.append(lambda e: grads.append(whole_gradients(e)) if not grads else None)
    loader = ShardedBatches(task, GLOBAL_BATCH, dp_rank=engine.mesh.index("dp"), dp_size=engine.mesh.size("dp"))
    strategy = engine.strategy
    losses, norms = [], []
    for step in range(STEPS):
        if isinstance(strategy, FullyShardedStrategy) and step == STEPS - 1:
            strategy.trace = []
        stats = engine.train_step(loader.batch_at(step))
        losses.append(stats.loss)
        norms.append(stats.grad_norm)
    result: dict = {"losses": losses, "grad_norms": norms, "grads": grads[0]}
    if isinstance(strategy, FullyShardedStrategy):
        trace = strategy.trace or []
        strategy.trace = None
        units = [u for u in strategy.units if not u.empty]
        result["gathers"] = {}
        for event in trace:
            if event[0] == "gather":
                result["gathers"][event[2]] = result["gathers"].get(event[2], 0) + 1
        result["units"] = len(units)
        result["rest"] = all(
            u.state is UnitState.FREE
            and u.gathered_bytes() == 0
            and not any(p.numel() for p in u.params)
            and all(p.grad is None for p in u.params)
            for u in units
        )
    result["eval"] = engine.evaluate([loader.batch_at(STEPS)]).loss
    result["first_stage"] = engine.mesh.index("pp") == 0
    result["params"] = whole_parameters(engine)
    return result


def _deep_peak() -> dict:
    """One 1F1B step of an 8-block GPT at dp2 x pp2 x ZeRO-3 (4 blocks per stage): the most units gathered at once
    within an F or B action, and how many units this rank holds."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=12, seq_len=8, n_layer=8, n_head=4, d_model=16, bias=False))
    layout = Layout(dp=2, pp=2, zero=3, microbatches=2, schedule="1f1b")
    engine = plait.parallelize(model, layout, optimizer=optimizer)
    tokens = torch.randint(0, 12, (4, 8), generator=torch.Generator().manual_seed(1))
    engine.train_step((tokens, tokens))
    stages = engine.strategy._stages
    return {"peak": stages.peak_gathered, "blocks": sum(len(b) for b in stages.blocks.values())}


def _train_gpt_cases(names: list[str]) -> dict[str, dict]:
    return {**{name: _train_gpt(Layout(**GPT_CASES[name])) for name in names}, "deep": _deep_peak()}


@pytest.fixture(scope="module")
def reference():
    return reference_trajectory()


@pytest.fixture(scope="module")
def four_rank_runs() -> dict[str, list[dict]]:
    names = list(GPT_CASES)
    per_rank = run_distributed(_train_gpt_cases, 4, names, timeout=300, comm_timeout_s=60)
    return {name: [results[name] for results in per_rank] for name in [*names, "deep"]}


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(GPT_CASES))
def test_zero_with_pipeline_and_tensor_parallel_matches_single_device(name, four_rank_runs, reference):
    layout = Layout(**GPT_CASES[name])
    assert_combo_matches(_combo(layout), four_rank_runs[name], reference)  # tolerances: composition.py (fp32)


@pytest.mark.distributed
@pytest.mark.parametrize("name", [n for n, kw in GPT_CASES.items() if kw["zero"] == 3 and kw.get("pp", 1) > 1])
def test_zero3_under_pipeline_gathers_per_action_and_holds_only_shards_between_steps(name, four_rank_runs):
    """One step of m micro-batches: each unit gathered once per F and B (zero-bubble: F, I and W) of each
    micro-batch on each of its stage's actions, nothing else; after the step every unit is back to its shard."""
    m = GPT_CASES[name]["microbatches"]
    for rank, result in enumerate(four_rank_runs[name]):
        kinds = ("F", "B")
        if GPT_CASES[name]["schedule"] == "zero-bubble":  # the first stage's I needs no weights
            kinds = ("F", "W") if result["first_stage"] else ("F", "I", "W")
        assert result["rest"], f"{name} rank {rank}: a unit holds gathered weights or gradients after the step"
        assert result["gathers"] == {kind: m * result["units"] for kind in kinds}, (name, rank, result["gathers"])


@pytest.mark.distributed
def test_zero3_under_pipeline_gathers_one_block_at_a_time_in_forward_and_backward(four_rank_runs):
    """4 blocks per stage: within an F or B action at most the stage's root unit (embeddings, or final norm and
    head) and two blocks (the one computing and the next one prefetched) are gathered, never the whole stage."""
    for rank, result in enumerate(four_rank_runs["deep"]):
        assert result["blocks"] == 4, result
        assert 2 <= result["peak"] <= 3, f"rank {rank}: {result['peak']} units gathered at once"


def _check_all_axes() -> dict:
    return _train_gpt(Layout(**ALL_AXES))


@pytest.mark.distributed
def test_dp2_tp2_pp2_zero3_matches_single_device(reference):
    per_rank = run_distributed(_check_all_axes, 8, timeout=300, comm_timeout_s=60)
    assert_combo_matches(_combo(Layout(**ALL_AXES)), per_rank, reference)
    assert all(result["rest"] for result in per_rank)


# ----------------------------------------------------------------- Hugging Face models
HF_CASES = [
    ("llama", dict(dp=2, tp=2, zero=3)),
    ("gpt2", dict(dp=2, pp=2, zero=2, microbatches=2, schedule="1f1b")),
]  # tied wte / lm_head across stages
"""Hugging Face models at 4 ranks (one process start-up): Llama with ZeRO-3 over tp slices, GPT-2 with ZeRO-2
under the pipeline (the last stage's copy of the tied embedding adds its gradient to the owner's before the
reduce-scatter)."""


def _train_hf(kind: str, fields: dict) -> dict:
    """tests/test_hf.py's 5 steps: losses, step-0 gradients and final parameters, whole (ZeRO shards gathered over
    dp, tp slices over tp), by name, of the stages this rank holds."""
    from helpers.hf import CLIP as HF_CLIP
    from helpers.hf import GLOBAL_BATCH as HF_BATCH
    from helpers.hf import STEPS as HF_STEPS
    from helpers.hf import global_batch
    from helpers.hf import make_model as hf_model
    from helpers.hf import optimizer as hf_optimizer

    from plait.parallel.tensor.layers import gather_slice, is_tp_sharded

    engine = plait.parallelize(hf_model(kind), Layout(**fields), optimizer=hf_optimizer, max_grad_norm=HF_CLIP)
    dp_rank, dp = engine.mesh.index("dp"), engine.mesh.size("dp")

    def whole(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            name: (gather_slice(local[name], p, engine.comm) if is_tp_sharded(p) else local[name]).clone()
            for name, p in engine.model.named_parameters()
        }

    grads: list[dict[str, torch.Tensor]] = []
    engine.before_optimizer_step.append(
        lambda e: grads.append(whole(e.strategy.full_gradients())) if not grads else None
    )
    losses, share = [], HF_BATCH // dp
    for step in range(HF_STEPS):
        inputs, targets = global_batch(step)
        rows = slice(dp_rank * share, (dp_rank + 1) * share)
        losses.append(engine.train_step((inputs[rows], targets[rows])).loss)
    return {"losses": losses, "grads": grads[0], "params": whole(engine.strategy.full_parameters())}


def _train_hf_cases() -> list[dict]:
    return [_train_hf(kind, fields) for kind, fields in HF_CASES]


@pytest.mark.distributed
def test_hf_llama_dp2_tp2_zero3_and_gpt2_dp2_pp2_zero2_match_single_device():
    from helpers.hf import GRAD_TOL, LOSS_RTOL, PARAM_TOL
    from helpers.hf import reference as hf_reference
    from helpers.reference import assert_tensors_close

    per_rank = run_distributed(_train_hf_cases, 4, timeout=300, comm_timeout_s=60)
    for index, (kind, fields) in enumerate(HF_CASES):
        expected, what = hf_reference(kind), f"{kind} {Layout(**fields).short()}"
        results = [rank_results[index] for rank_results in per_rank]
        merged: dict[str, dict[str, torch.Tensor]] = {"grads": {}, "params": {}}
        for rank, result in enumerate(results):  # fp32 tolerances of tests/test_hf.py (reordered sums; see there)
            for step, (a, e) in enumerate(zip(result["losses"], expected.losses, strict=True)):
                assert abs(a - e) <= LOSS_RTOL * abs(e), f"{what} rank {rank} step {step}: loss {a!r} != {e!r}"
            for field in merged:  # pipeline stages: the union by name; replicas must agree bitwise
                for name, tensor in result[field].items():
                    assert name not in merged[field] or torch.equal(merged[field][name], tensor), (what, name)
                    merged[field][name] = tensor
        assert_tensors_close(merged["grads"], expected.grads[0], f"{what} step 0 grad", GRAD_TOL)
        assert_tensors_close(merged["params"], expected.params[-1], f"{what} final param", PARAM_TOL)


# ----------------------------------------------------------------- refusals (one process, before any collective)
def test_zero3_with_tied_embeddings_across_pipeline_stages_is_refused():
    from helpers.hf import make_model as hf_model

    model = hf_model("gpt2")  # wte and lm_head tied: the first and the last stage share them
    with mock_world(4):
        with pytest.raises(LayoutError, match="not supported with zero=3.*Fix: untie them"):
            plait.parallelize(model, Layout(dp=2, pp=2, zero=3, microbatches=2), optimizer=optimizer)


def test_zero3_with_grid_tensor_parallel_and_zero2_with_pipedream_are_refused():
    with pytest.raises(LayoutError, match="zero=3 with tp=4 is not supported in tp_mode='2d'.*Fix:"):
        check_in_one_process(4, Layout(tp=4, tp_mode="2d", zero=3))
    model, _ = make_model()
    with mock_world(4), pytest.raises(LayoutError, match="schedule='pipedream' with zero=2.*Fix:"):
        plait.parallelize(model, Layout(dp=2, pp=2, zero=2, microbatches=2, schedule="pipedream"), optimizer=optimizer)


def mock_world(world: int) -> contextlib.ExitStack:
    """parallelize's checks as if this process were a rank of ``world`` (composition.check_in_one_process's
    patches, for a model and arguments of our own): a refusal is raised before the mesh exists."""
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch("plait.parallelize.dist.is_initialized", return_value=True))
    stack.enter_context(mock.patch("plait.parallelize.dist.get_world_size", return_value=world))
    stack.enter_context(mock.patch("plait.parallelize.Mesh.build", side_effect=AssertionError("not refused")))
    return stack
