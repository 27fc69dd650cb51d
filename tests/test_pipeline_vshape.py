"""V-shaped pipelines (ZB-V, DualPipeV): the placement as data, the schedules valid and deadlock-free for p = 2..8,
their bubbles and in-flight activations against 1F1B and ZB-H1 on the simulator, the layout's checks, and parity
with single-device training (losses, gradients before clipping's norm, gradients, parameters, evaluation) at
pp = 2 and 4, m = 2p and uneven m, clipped and not, on rows scoring uneven numbers of tokens, alone and with
dp x ZeRO-3 and tp. The program checker (tests/test_pipeline_program.py) runs their lowered programs too.

Costs: a V runs 2p chunks of half a stage each, so it is compared with 1F1B / ZB-H1 at equal work: chunk costs
F = 1/2, B = 1 (I = W = 1/2) against stage costs F = 1, B = 2.
"""

from __future__ import annotations

import pytest
import torch
from helpers.composition import (
    CLIP,
    GRAD_TOL,
    LOSS_RTOL,
    NORM_RTOL,
    PARAM_TOL,
    check_in_one_process,
    merge_ranks,
    optimizer,
    whole_gradients,
    whole_parameters,
)
from helpers.harness import run_distributed
from helpers.reference import UnevenMasks, assert_tensors_close, train_reference

import plait
from plait import Layout, LayoutError
from plait.data import AdditionTask, ShardedBatches
from plait.models import GPT, GPTConfig
from plait.models.loss import apply_loss
from plait.parallel.pipeline import (
    Action,
    Schedule,
    ScheduleError,
    build_schedule,
    lower,
    one_f_one_b,
    simulate,
    zero_bubble,
)
from plait.parallel.pipeline.schedule import Kind, Placement, stage_rank
from plait.planner.inter_op import rank_balanced_stages, rank_loads
from plait.planner.predict import pipeline_closed_form, predict
from plait.planner.search import _schedules, plan

STAGE = {"F": 1, "B": 2}
CHUNK = {"F": 0.5, "B": 1}
V_NAMES = ("zb-v", "dualpipev")


def v_ms(name: str, p: int) -> list[int]:
    """Micro-batch counts each schedule accepts, around its threshold (ZB-V any m, DualPipeV m >= 2p)."""
    low = 1 if name == "zb-v" else 2 * p
    return sorted({low, low + 1, 2 * p - 1 if name == "zb-v" else low, 2 * p, 2 * p + 3, 3 * p})


# ----------------------------------------------------------------- placement as data
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_v_placement_puts_both_ends_on_rank_0_and_the_turn_on_rank_p_minus_1(p):
    schedule = build_schedule("zb-v", p, 2 * p)
    assert schedule.placement == Placement.V and schedule.v == 2
    for r in range(p):
        assert schedule.stages_on(r) == sorted({r, 2 * p - 1 - r})
    assert schedule.rank_of(0) == schedule.rank_of(2 * p - 1) == 0
    assert schedule.rank_of(p - 1) == schedule.rank_of(p) == p - 1
    assert [stage_rank(s, p, "interleaved") for s in range(2 * p)] == [s % p for s in range(2 * p)]
    assert [stage_rank(s, p, "v") for s in range(4 * p)] == [*range(p), *reversed(range(p))] * 2  # v = 4: a W


def test_placement_travels_in_the_text_and_csv_forms(tmp_path):
    schedule = build_schedule("dualpipev", 2, 4)
    text = schedule.to_text()
    assert text.splitlines()[0].endswith("placement=v")
    assert Schedule.from_text(text) == schedule
    assert Schedule.from_csv(schedule.to_csv(tmp_path / "v.csv")) == schedule
    interleaved = build_schedule("1f1b", 2, 4)
    assert "placement" not in interleaved.to_text(), "the default placement keeps the old header"
    body = "\n".join(text.splitlines()[1:])
    with pytest.raises(
        ScheduleError, match=r"rank 0 runs 3F0, but stage 3 lives on rank 1 \(stage s lives on rank s % p\)"
    ):
        Schedule.from_text(body).validate()  # without the header the stages are on the wrong ranks
    assert Schedule.from_text(body, placement="v").validate() == schedule
    with pytest.raises(ScheduleError, match="unknown placement 'w'"):
        Schedule(2, 1, [[], []], 2, placement="w")


def test_the_turn_of_the_v_is_a_local_hand_over_in_the_lowered_schedule():
    p = 4
    lowered = lower(build_schedule("zb-v", p, 8))
    comms = {a for acts in lowered.actions for a in acts if a.is_comm}
    assert Action(p - 1, Kind.SEND_FORWARD, 0) not in comms and Action(p, Kind.RECV_FORWARD, 0) not in comms
    assert Action(p, Kind.SEND_BACKWARD, 0) not in comms and Action(p - 1, Kind.RECV_BACKWARD, 0) not in comms
    assert Action(0, Kind.SEND_FORWARD, 0) in comms and Action(2 * p - 1, Kind.RECV_FORWARD, 0) in comms


# ----------------------------------------------------------------- the schedules on the simulator
@pytest.mark.parametrize("name", V_NAMES)
@pytest.mark.parametrize("p", range(2, 9))
def test_every_v_schedule_is_valid_and_deadlock_free_lowered_or_not(name, p):
    for m in v_ms(name, p):
        schedule = build_schedule(name, p, m)
        simulate(schedule, CHUNK)  # validates: each stage F and B (or I + W) of each micro-batch once, no deadlock
        simulate(lower(schedule), CHUNK)  # and the send/recv order under blocking rendezvous semantics


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_zb_v_idle_is_zb_h1s_closed_form_on_half_stage_chunks(p):
    """Idle per rank (p - 1)(tF + tI - tW) of a chunk at tF = tI = tW and at tI = 2 tF = 2 tW, any m >= 2p - 1
    (ZB-V's order is fixed, not fitted to the costs: elsewhere it lands near, not on, this form)."""
    for m in (2 * p - 1, 2 * p, 3 * p + 1):
        for costs in ({"F": 1, "I": 1, "W": 1}, {"F": 1, "I": 2, "W": 1}, {"F": 0.5, "I": 0.5, "W": 0.5}):
            result = simulate(build_schedule("zb-v", p, m), {"B": costs["I"] + costs["W"], **costs})
            idle = (p - 1) * (costs["F"] + costs["I"] - costs["W"])
            assert result.idle == pytest.approx([idle] * p), (m, costs)


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("m_per_p", [2, 4])
def test_v_bubbles_are_below_1f1b_and_zb_h1_at_equal_work(p, m_per_p):
    m = m_per_p * p
    f1b = simulate(one_f_one_b(p, m), STAGE).bubble_fraction
    h1 = simulate(zero_bubble(p, m), STAGE).bubble_fraction
    for name in V_NAMES:
        bubble = simulate(build_schedule(name, p, m), CHUNK).bubble_fraction
        assert bubble < h1 < f1b, (name, bubble, h1, f1b)
        assert bubble == pytest.approx(f1b / 6, rel=0.35), "about a sixth of 1F1B's (module doc)"


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_in_flight_activations_zb_v_as_1f1b_dualpipev_half_a_stage_more(p):
    """In half-stage chunks: ZB-V holds at most 2p on every rank, 1F1B's rank 0 p whole stages (= 2p chunks);
    DualPipeV 2p + 1."""
    for m in (2 * p, 3 * p + 1):
        f1b = max(simulate(one_f_one_b(p, m)).peak_activations)
        assert f1b == p
        assert simulate(build_schedule("zb-v", p, m)).peak_activations == [2 * f1b] * p
        assert simulate(build_schedule("dualpipev", p, m)).peak_activations == [2 * f1b + 1] * p


def test_dualpipev_pairs_a_forward_with_another_micro_batchs_backward():
    """Steady state: each forward of one chunk is followed by the backward of the other chunk on an earlier
    micro-batch (the pair that runs overlapped on hardware)."""
    p, m = 4, 12
    schedule = build_schedule("dualpipev", p, m)
    for r, acts in enumerate(schedule.actions):
        down, up = r, 2 * p - 1 - r
        pairs = [
            (a, b)
            for a, b in zip(acts, acts[1:])
            if a.kind == Kind.FORWARD and b.kind == Kind.BACKWARD and {a.stage, b.stage} == {down, up}
        ]
        assert len(pairs) >= 2 * (m - 2 * p + r + 1) - 1, (r, len(pairs))
        assert all(a.microbatch > b.microbatch for a, b in pairs)


def test_v_schedules_refuse_what_they_cannot_run():
    with pytest.raises(ScheduleError, match="m >= 2p = 8"):
        build_schedule("dualpipev", 4, 7, 2)
    with pytest.raises(ScheduleError, match="two model chunks per rank"):
        build_schedule("zb-v", 4, 8, 3)


# ----------------------------------------------------------------- the layout
def test_layout_gives_a_v_two_chunks_and_refuses_other_counts():
    assert Layout(pp=2, schedule="zb-v").virtual_stages == 2
    assert Layout(pp=2, schedule="dualpipev", virtual_stages=2).virtual_stages == 2
    with pytest.raises(LayoutError, match="virtual_stages=2"):
        Layout(pp=2, schedule="zb-v", virtual_stages=4)
    with pytest.raises(LayoutError, match="recompute='op' cannot run under schedule='zb-v'"):
        Layout(pp=2, schedule="zb-v", recompute="op")
    with pytest.raises(LayoutError, match="pipeline_cuts=.* needs 4"):
        Layout(pp=2, schedule="zb-v", pipeline_cuts=(2,))
    assert Layout.from_dict(Layout(pp=2, schedule="zb-v").to_dict()) == Layout(pp=2, schedule="zb-v")


def test_parallelize_refuses_dualpipev_with_too_few_microbatches_before_any_collective():
    model = make_model()[0]
    with pytest.raises(LayoutError, match="dualpipev needs at least as many micro-batches as stages"):
        check_in_one_process(4, Layout(pp=2, dp=2, microbatches=2, schedule="dualpipev"), model=model)
    check_in_one_process(4, Layout(pp=2, dp=2, microbatches=4, schedule="dualpipev", zero=3), model=model)
    check_in_one_process(4, Layout(pp=2, tp=2, dp=1, microbatches=2, schedule="zb-v", zero=1), model=model)
    with pytest.raises(LayoutError, match="needs pp x virtual_stages = 8 stages, but the model has only 4"):
        check_in_one_process(4, Layout(pp=4, dp=1, microbatches=8, schedule="zb-v"), model=make_model(n_layer=4)[0])


# ----------------------------------------------------------------- the planner
def test_inter_op_balances_a_vs_ranks_with_both_ends_on_rank_0():
    """Equal blocks with a heavy embedding (first) and output layer (last): in a V both extras are rank 0's, so
    rank 0 gets the fewest blocks and the ranks' totals are balanced over chunks r and 2p - 1 - r."""
    p, v = 4, 2
    costs = [3.0] + [1.0] * 22 + [4.0]
    chunks = rank_balanced_stages(costs, p, v, "v")
    assert len(chunks) == p * v and chunks[0][0] == 0 and chunks[-1][1] == len(costs)
    loads = rank_loads(costs, chunks, p, "v")
    assert max(loads) - min(loads) <= 1.0 + 1e-9, loads
    blocks = [sum(j - i for i, j in (chunks[r], chunks[2 * p - 1 - r])) for r in range(p)]
    assert blocks[0] == min(blocks) < max(blocks), blocks
    interleaved = rank_loads(costs, chunks, p)  # the same cuts read as interleaved are unbalanced
    assert max(interleaved) > max(loads)


def test_planner_offers_and_prices_the_v_schedules():
    assert ("zb-v", 2) in _schedules(4, 4, 24, ("zb-v", "dualpipev"), ())
    assert ("dualpipev", 2) not in _schedules(4, 4, 24, ("zb-v", "dualpipev"), ()), "m >= 2p"
    assert ("dualpipev", 2) in _schedules(4, 8, 24, ("zb-v", "dualpipev"), ())
    assert _schedules(4, 8, 7, ("zb-v", "dualpipev"), ()) == [], "2 pp chunks need 2 pp layers"
    runs = {}
    for schedule in ("1f1b", "zero-bubble", "zb-v", "dualpipev"):
        layout = Layout(dp=2, pp=4, microbatches=16, schedule=schedule, precision="bf16")
        exact = predict("gpt2", layout, "h100", global_batch=32, exact=True)
        fast = predict("gpt2", layout, "h100", global_batch=32, exact=False)
        if schedule in V_NAMES:  # the search's closed form and the simulator on unequal chunks (embedding, head)
            assert fast.step_time == pytest.approx(exact.step_time, rel=0.03), schedule
        runs[schedule] = exact
    bubble = {name: run.time["pp_bubble"] for name, run in runs.items()}
    assert bubble["zb-v"] < bubble["zero-bubble"] < bubble["1f1b"] and bubble["dualpipev"] < bubble["1f1b"]
    # memory: every rank of a V holds 2p chunk activations (ZB-V), 2p + 1 (DualPipeV), priced on its own chunks
    assert [pipeline_closed_form(name, 4, 16, 2, 1.0, 2.0, 0.0)[2] for name in V_NAMES] == [8, 9]
    memory = {name: run.memory.activations for name, run in runs.items()}
    assert memory["dualpipev"] > memory["zb-v"], "DualPipeV: half a stage more"
    with pytest.raises(LayoutError, match="dualpipev needs microbatches >= 2 x pp = 8"):
        predict("gpt2", Layout(dp=2, pp=4, microbatches=4, schedule="dualpipev"), "h100", global_batch=8)


def test_plan_searches_the_v_schedules():
    result = plan("gpt2", 8, "h100", global_batch=64, top=50, schedules=("zb-v", "dualpipev"))
    shapes = {(p.layout.schedule, p.layout.virtual_stages) for p in result.candidates if p.layout.pp > 1}
    assert shapes and shapes <= {("zb-v", 2), ("dualpipev", 2)}, shapes


# ----------------------------------------------------------------- parity with one device
STEPS = 3


def make_model(n_layer: int = 8, tied: bool = False) -> tuple[GPT, UnevenMasks]:
    """The tiny reference GPT (8 blocks: 2p = 8 chunks at pp = 4) on the addition task, rows scoring uneven
    numbers of tokens (so the token-mean normalisation over the global batch is part of every check); ``tied``:
    the LM head shares the token embedding's weight (the first and the last stage: both on rank 0 in a V)."""
    task = AdditionTask(digits=2, seed=1)
    torch.manual_seed(1234)
    # bias=False: the key bias's gradient is analytically zero, i.e. rounding noise (docs/testing.md)
    config = GPTConfig(
        vocab_size=task.vocab_size, seq_len=task.seq_len, n_layer=n_layer, n_head=4, d_model=16, bias=False
    )
    model = GPT(config)
    if tied:
        model.lm_head.weight = model.tok_embed.weight
    return model, UnevenMasks(task)


def reference(global_batch: int, clip: float | None, tied: bool = False) -> dict:
    model, task = make_model(tied=tied)
    loader = ShardedBatches(task, global_batch)
    out = train_reference(model, [loader.global_batch_at(s) for s in range(STEPS)], optimizer, max_grad_norm=clip)
    model.load_state_dict(out.params[-1], strict=not tied)  # a tied head is named once (as tok_embed.weight)
    inputs, targets = loader.global_batch_at(STEPS)
    with torch.no_grad():
        evaluation = float(apply_loss(torch.nn.functional.cross_entropy, model(inputs), targets))
    return {"losses": out.losses, "norms": out.grad_norms, "grads": out.grads, "params": out.params, "eval": evaluation}


def train_v(layout: dict, global_batch: int, clip: float | None) -> dict:
    """This rank's run: losses and norms per step, its stages' whole gradients and parameters per step, and the
    evaluation loss of the trained model on the next batch (the V's forward-only chain ends on rank 0)."""
    layout = dict(layout)
    tied = layout.pop("tied", False)
    model, task = make_model(tied=tied)
    engine = plait.parallelize(model, Layout(**{"dp": 1, **layout}), optimizer=optimizer, max_grad_norm=clip)
    if tied and engine.mesh.index("pp") == 0:  # rank 0 holds both ends of the V: one parameter, no copy
        assert engine.model.lm_head.weight is engine.model.tok_embed.weight, "the tie is kept on rank 0"
    grads: list[dict[str, torch.Tensor]] = []
    engine.before_optimizer_step.append(lambda e: grads.append(whole_gradients(e)))
    loader = ShardedBatches(task, global_batch, dp_rank=engine.mesh.index("dp"), dp_size=engine.mesh.size("dp"))
    stats, params = [], []
    for step in range(STEPS):
        stats.append(engine.train_step(loader.batch_at(step)))
        params.append(whole_parameters(engine))
    return {
        "losses": [s.loss for s in stats],
        "norms": [s.grad_norm for s in stats],
        "grads": grads,
        "params": params,
        "eval": engine.evaluate([loader.batch_at(STEPS)]).loss,
    }


def train_all(cases: list[tuple[dict, int, float | None]]) -> list[dict]:
    world = torch.distributed.get_world_size()
    return [train_v(layout, batch, clip) for layout, batch, clip in cases if _world(layout) == world]


def _world(layout: dict) -> int:
    return layout["pp"] * layout.get("dp", 1) * layout.get("tp", 1)


def assert_matches(case: tuple[dict, int, float | None], per_rank: list[dict]) -> None:
    layout, batch, clip = case
    what = f"{layout} batch={batch} clip={clip}"
    expected = reference(batch, clip, layout.get("tied", False))
    for rank, result in enumerate(per_rank):
        assert result["losses"] == per_rank[0]["losses"], f"{what}: rank {rank} reports another loss"
        assert result["eval"] == per_rank[0]["eval"], f"{what}: rank {rank} reports another evaluation loss"
    # fp32: micro-batching and the V reorder the batch's sums (a few ulps: helpers/composition.py's tolerances)
    for name, actual, wanted in [("loss", a, e) for a, e in zip(per_rank[0]["losses"], expected["losses"])] + [
        ("evaluation", per_rank[0]["eval"], expected["eval"])
    ]:
        assert abs(actual - wanted) <= LOSS_RTOL * abs(wanted), f"{what}: {name} {actual!r} != {wanted!r}"
    if clip:  # the norm before clipping: a sum of squares over both chunks of every rank, reduced over pp
        for actual, wanted in zip(per_rank[0]["norms"], expected["norms"], strict=True):
            assert abs(actual - wanted) <= NORM_RTOL * wanted, f"{what}: grad norm {actual!r} != {wanted!r}"
    for step in range(STEPS):
        grads = merge_ranks([r["grads"][step] for r in per_rank], f"{what} step {step} grads")
        params = merge_ranks([r["params"][step] for r in per_rank], f"{what} step {step} params")
        assert params.keys() == expected["params"][step].keys(), f"{what}: a parameter is on no rank"
        assert_tensors_close(grads, expected["grads"][step], f"{what} step {step} grad", GRAD_TOL)
        assert_tensors_close(params, expected["params"][step], f"{what} step {step} param", PARAM_TOL)


CI_CASES = [
    (dict(pp=2, microbatches=4, schedule="zb-v"), 8, CLIP),  # m = 2p
    (dict(pp=2, microbatches=2, schedule="zb-v"), 8, None),  # m < 2p - 1: the V never fills
    (dict(pp=2, microbatches=5, schedule="dualpipev"), 10, CLIP),  # m = 2p + 1
    (dict(pp=4, microbatches=8, schedule="zb-v"), 8, None),
    (dict(pp=4, microbatches=8, schedule="dualpipev"), 8, CLIP),
    (dict(pp=2, dp=2, zero=3, microbatches=4, schedule="zb-v"), 16, CLIP),
    (dict(pp=2, dp=2, zero=3, microbatches=4, schedule="dualpipev"), 16, None),
    (dict(pp=2, tp=2, microbatches=4, schedule="dualpipev"), 8, CLIP),
    (dict(pp=2, tp=2, microbatches=3, schedule="zb-v"), 12, None),
    (dict(pp=2, microbatches=4, schedule="dualpipev", tied=True), 8, CLIP),  # both uses of the tie on rank 0
]
"""(layout, global batch, clip): each schedule at pp = 2 and 4, m = 2p and uneven m, clipped and not, with
dp x ZeRO-3 and with tp (4 ranks each), and tied embeddings (``tied``: one parameter on rank 0, no copy)."""
LONG_CASES = [
    (dict(pp=2, microbatches=4, schedule="dualpipev"), 8, None),
    (dict(pp=2, microbatches=3, schedule="zb-v"), 12, CLIP),
    (dict(pp=4, microbatches=5, schedule="zb-v"), 10, CLIP),  # m < 2p - 1 at pp = 4
    (dict(pp=4, microbatches=9, schedule="dualpipev"), 9, None),  # m = 2p + 1 at pp = 4
    (dict(pp=2, dp=2, zero=1, microbatches=4, schedule="dualpipev"), 16, CLIP),
    (dict(pp=2, dp=2, zero=2, microbatches=2, schedule="zb-v"), 8, CLIP),
    (dict(pp=2, tp=2, sequence_parallel=True, microbatches=4, schedule="zb-v"), 8, CLIP),
    (dict(pp=2, tp=2, microbatches=4, schedule="dualpipev", recompute="full"), 8, None),
]
"""More of the same behind marker ``long``: the other uneven m, ZeRO-1/2, tp with sequence parallelism,
recomputation."""


def _run(cases: list[tuple[dict, int, float | None]]) -> None:
    for world in sorted({_world(layout) for layout, _, _ in cases}):
        mine = [case for case in cases if _world(case[0]) == world]
        per_rank = run_distributed(train_all, world, mine, timeout=300)
        for index, case in enumerate(mine):
            assert_matches(case, [results[index] for results in per_rank])


@pytest.mark.distributed
def test_v_schedules_match_single_device():
    _run(CI_CASES)


@pytest.mark.distributed
@pytest.mark.long
def test_v_schedules_match_single_device_long():
    _run(LONG_CASES)
