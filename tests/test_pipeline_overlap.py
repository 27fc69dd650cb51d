"""DualPipeV's overlapped pair (plait/parallel/pipeline/overlap.py): the baton's order, the deadlock-freedom of the
pairs' dependency rule on the simulator, and the fused pair bitwise against the pair run in order at dp2 x pp2 x
ep2 (the MoE GPT of tests/helpers/moe.py, uneven routing), with the exchanges asynchronous in both directions."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers.harness import run_distributed

from plait.parallel.pipeline import build_schedule, simulate
from plait.parallel.pipeline.overlap import Baton, run_pair
from plait.parallel.pipeline.schedule import Kind, Schedule


# ----------------------------------------------------------------- the baton
def test_pair_runs_one_party_at_a_time_switching_where_they_say():
    log: list[str] = []
    hook: list = [None]

    def party(name: str, steps: int):  # noqa: ANN202
        def run() -> None:
            for step in range(steps):
                log.append(f"{name}{step}")
                hook[0]()  # a switch point (an exchange in flight)

        return run

    run_pair(party("f", 3), party("b", 5), lambda h: hook.__setitem__(0, h))
    assert log == ["f0", "b0", "f1", "b1", "f2", "b2", "b3", "b4"], "alternating, then the rest of the longer one"
    assert hook[0] is None, "the hook is removed after the pair"


def test_pair_raises_the_helpers_error_after_both_ended():
    seen: list[str] = []

    def fails() -> None:
        raise ValueError("backward failed")

    with pytest.raises(ValueError, match="backward failed"):
        run_pair(lambda: seen.append("forward"), fails, lambda h: None)
    assert seen == ["forward"]
    assert not [t for t in threading.enumerate() if t.name == "plait-pipeline-pair"], "the helper was joined"


def test_baton_switch_returns_at_once_when_the_other_party_has_finished():
    baton = Baton()
    baton.enter(0)
    baton._running[1] = False  # the helper is done
    baton.switch()  # must not block


# ----------------------------------------------------------------- deadlock-freedom of the pairs' rule
def _swapped(schedule: Schedule) -> tuple[Schedule, int]:
    """``schedule`` with each adjacent (F, full B of another stage) pair in the other order: the dependency rule
    of the overlapped pair (both inputs before it starts, the forward's output after it ends)."""
    actions, swapped = [list(acts) for acts in schedule.actions], 0
    for acts in actions:
        i = 0
        while i < len(acts) - 1:
            a, b = acts[i], acts[i + 1]
            if a.kind == Kind.FORWARD and b.kind == Kind.BACKWARD and a.stage != b.stage:
                acts[i], acts[i + 1] = b, a
                swapped += 1
                i += 2
            else:
                i += 1
    return Schedule(schedule.p, schedule.m, actions, schedule.v, "swapped", schedule.placement), swapped


@pytest.mark.parametrize("p", range(2, 9))
def test_dualpipev_pairs_swapped_are_deadlock_free(p):
    """The runtime waits for both chunks' inputs before a pair and posts both outputs after it: what the pairs
    swapped (backward first) require. ``simulate`` raises on a deadlock; the bubble does not move."""
    for m in (2 * p, 2 * p + 1, 3 * p, 4 * p):
        schedule = build_schedule("dualpipev", p, m)
        swapped, count = _swapped(schedule)
        assert count >= p * (m - 2 * p + 1), (p, m, count)
        costs = {"F": 0.5, "B": 1}
        assert simulate(swapped, costs).makespan == pytest.approx(simulate(schedule, costs).makespan)


# ----------------------------------------------------------------- bitwise against the pair in order
def _train(overlap: bool, zero: int) -> dict:
    from helpers.composition import optimizer, whole_gradients, whole_parameters
    from helpers.moe import GLOBAL_BATCH, make_model

    import plait
    from plait.data import ShardedBatches
    from plait.observe.trace import Tracer
    from plait.parallel.pipeline import overlap as overlap_module

    model, task = make_model()
    layout = plait.Layout(dp=2, pp=2, ep=2, microbatches=4, schedule="dualpipev", zero=zero)
    engine = plait.parallelize(model, layout, optimizer=optimizer, max_grad_norm=0.05)
    runner = engine.pipeline
    assert runner.overlap_pairs, "ep > 1 on gloo (ZeRO-3 too): the pairs are overlapped by default"
    runner.overlap_pairs = overlap
    pairs = [0]
    original = overlap_module.run_pair

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        pairs[0] += 1
        return original(*args, **kwargs)

    import plait.parallel.pipeline.runtime as runtime_module

    runtime_module.run_pair = counting
    grads: list[dict] = []
    engine.before_optimizer_step.append(lambda e: grads.append(whole_gradients(e)))
    loader = ShardedBatches(task, GLOBAL_BATCH, dp_rank=engine.mesh.index("dp"), dp_size=engine.mesh.size("dp"))
    tracer = Tracer(engine).start()
    try:
        losses = [engine.train_step(loader.batch_at(step)).loss for step in range(2)]
    finally:
        tracer.stop()
        runtime_module.run_pair = original
    flights = sum(1 for f in tracer.flights if f[0] == "all_to_all_v ep")
    return {"losses": losses, "grads": grads, "params": whole_parameters(engine), "pairs": pairs[0], "flights": flights}


def _both(zero: int) -> dict:
    return {"in order": _train(False, zero), "overlapped": _train(True, zero)}


@pytest.mark.distributed
@pytest.mark.parametrize("zero", [0, 3])
def test_overlapped_pairs_are_bitwise_the_pairs_in_order(zero):
    """zero=3: each chunk of a pair gathers its own stage's units in its own scope, and rank 0's pairs (stage 0's
    forward with stage 3's backward, and the reverse) share the root unit (embeddings and head), freed when the
    later of the two ends."""
    per_rank = run_distributed(_both, 4, zero, timeout=300)
    for rank, runs in enumerate(per_rank):
        plain, fused = runs["in order"], runs["overlapped"]
        assert plain["pairs"] == 0 and fused["pairs"] > 0, (rank, fused["pairs"])
        # in order only the forward dispatch is asynchronous (the shared experts); overlapped, every exchange
        # inside a pair is (forward dispatch and combine, backward of both)
        assert fused["flights"] > plain["flights"], (rank, fused["flights"], plain["flights"])
        assert fused["losses"] == plain["losses"], rank
        for step, (a, b) in enumerate(zip(fused["grads"], plain["grads"], strict=True)):
            assert a.keys() == b.keys()
            for name in a:
                assert torch.equal(a[name], b[name]), f"rank {rank} step {step}: gradient of {name} differs"
        for name, tensor in plain["params"].items():
            assert torch.equal(fused["params"][name], tensor), f"rank {rank}: {name} differs"
