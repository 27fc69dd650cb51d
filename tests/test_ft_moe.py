"""Mixture-of-Experts models and fp16 loss scaling under per-step fault tolerance (plait/ft/experts.py,
docs/fault_tolerance.md): two replica groups of 2 ranks (ep=2 inside each) train exactly what one device trains
on the union of the committed groups' batches, with uneven loss masks (instruction data: each group scores another
share of its tokens, so N_g / B_g differs between the groups) and uneven routing; a replay that leaves a group out
equals one device on the other group's rows; fp16 keeps one loss-scale trajectory, HSDP's own."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import ft

from plait.checkpoint import load_full_state
from plait.data import prepare
from plait.distributed import World
from plait.errors import CheckpointError
from plait.ft import wire
from plait.ft.combine import combine
from plait.ft.experts import QuorumExperts
from plait.ft.log import ReplayLog, replica_dir
from plait.ft.state import engine_state, load_engine_state
from plait.parallel.expert.stats import RouterStats
from plait.parallel.loss_normalization import TokenMeanStep
from plait.train.config import load_config
from plait.train.loop import build

STEPS = 6
MOE = [
    "layout.dp_replicate=2",
    "layout.ep=2",
    "model.n_layer=2",
    "model.d_model=32",
    "model.n_head=4",
    "model.n_experts=4",
    "model.top_k=2",
    "model.moe_d_ff=16",
    "model.moe_start=1",
    "train.global_batch=8",
    "train.eval_every=0",
    "train.samples=0",
    "train.log_every=1",
    # SGD with momentum (tests/helpers/ft.py: Adam turns the rounding noise of zero-gradient biases into full steps)
    "train.optimizer=sgd",
    "train.lr=0.05",
    "train.momentum=0.9",
]
"""A tiny MoE GPT (block 1: 4 experts, top 2) over two replica groups with ep=2 inside each."""
ONE_DEVICE = ["layout.ep=1"]

LOSS_ATOL = 1e-6
"""fp32 losses: the groups' token means are combined as sum_g N_g L_g / N, one device sums at once (measured 4e-7)."""
PARAM_RTOL, PARAM_ATOL = 1e-5, 1e-7
"""fp32 parameters after 6 steps: sum_g N_g G_g / N against one device's one sum (measured 4e-9). The engine's own
balance weight 1 / B_g (no exchange) moves the router's gate 8e-6 away here: the tolerance tells them apart."""
FP16_ATOL, FP16_RTOL = 1e-5, 1e-4
"""fp16 autocast over fp32 master weights: activations round at 2^-11, so one fp32 ulp of a weight (the combine
sums in another order than HSDP's all-reduce) can move an activation by an fp16 ulp (measured after 10 steps:
parameters 4.4e-7, losses 1.2e-6 apart)."""
NORM_RTOL = 1e-6
"""The gradient norm before clipping, the balance loss: fp32 / fp64 sums in another order (measured 3e-7)."""


@pytest.fixture(scope="module")
def instructions(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A token folder of prompt / response records of different lengths (only responses score): uneven loss masks
    and packed documents of different lengths."""
    rng = random.Random(0)
    words = "the cat sat on a mat while experts route tokens to layers of many kinds".split()
    folder = tmp_path_factory.mktemp("instruct")
    lines = []
    for _ in range(400):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        response = " ".join(rng.choice(words) for _ in range(rng.randint(1, 6)))
        lines.append(json.dumps({"prompt": prompt + ": ", "response": response}) + "\n")
    (folder / "pairs.jsonl").write_text("".join(lines))
    prepare([folder / "pairs.jsonl"], folder / "tokens", val_fraction=0.0, progress=False, instruct=True)
    return folder / "tokens"


def _settings(data: Path, *extra: str) -> list[str]:
    return [*MOE, "data.name=tokens", f"data.path={data}", "data.seq_len=32", "data.attention=document", *extra]


def _final(run: Path, group: int) -> dict[str, torch.Tensor]:
    return load_full_state(replica_dir(run, group) / "ckpt")[0]


def _assert_one_device(
    run: Path,
    clipped: bool,
    steps: int = STEPS,
    loss_atol: float = LOSS_ATOL,
    param_atol: float = PARAM_ATOL,
    norm_rtol: float = NORM_RTOL,
) -> None:
    """The run's group-0 records and final state against one device trained on its committed rows, step by step:
    losses, gradient norms, routed and dropped tokens per expert, the balance loss, parameters, aux-free biases."""
    engine, reference = ft.one_device_steps(run, steps, ONE_DEVICE)
    records = ft.step_records(run, 0)
    for step, expected in enumerate(reference, start=1):
        got = records[step]
        assert abs(got["loss"] - expected.loss) < loss_atol, (step, got["loss"], expected.loss)
        assert got["moe"]["load"] == expected.moe.load and got["moe"]["dropped"] == expected.moe.dropped, step
        assert got["moe"]["aux_loss"] == pytest.approx(expected.moe.aux_loss, rel=norm_rtol, abs=1e-12), step
        if clipped:
            assert got["grad_norm"] == pytest.approx(expected.grad_norm, rel=norm_rtol), step
    final = _final(run, 0)
    for name, value in engine.module.state_dict().items():
        if name.endswith("expert_bias"):  # moved by sign(mean - load) of the same integer loads: the same bits
            assert torch.equal(final[name], value), name
        else:
            torch.testing.assert_close(final[name], value, rtol=PARAM_RTOL, atol=param_atol, msg=name)


def _assert_groups_agree(run: Path) -> None:
    """Both groups committed every step together, report the same numbers and hold the same bits."""
    zero, one = ft.step_records(run, 0), ft.step_records(run, 1)
    assert sorted(zero) == sorted(one) == list(range(1, STEPS + 1))
    for step in zero:
        for key in ("loss", "grad_norm", "skipped", "loss_scale", "moe"):
            assert zero[step].get(key) == one[step].get(key), (step, key)
    final = [_final(run, g) for g in (0, 1)]
    assert all(torch.equal(final[0][name], final[1][name]) for name in final[0])


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.cli
@pytest.mark.timeout(600)  # two 4-process runs and two one-device references: ~2 min on 2 busy cores
def test_moe_balance_loss_under_ft_equals_one_device_and_a_replay_leaves_a_group_out(instructions, tmp_path):
    """aux_loss balancing, clipped, ZeRO-2: the balance loss weighed W / (w_g B) across groups of uneven N_g / B_g;
    then a replay of a log without group 1 at steps 2-3 and without group 0 at step 5 (those groups add zeros)."""
    settings = _settings(instructions, "layout.zero=2", "model.aux_loss_coef=0.1", "train.max_grad_norm=0.5")
    run = tmp_path / "run"
    done = ft.run_ft(run, STEPS, settings=settings, env={"PLAIT_FT_TIMEOUT_S": "60"})
    assert done.returncode == 0, done.stderr[-3000:]
    ratios = ft.scored_per_sequence(run, 1, ONE_DEVICE)
    assert abs(ratios[0] - ratios[1]) > 1.0, ratios  # uneven N_g / B_g: the 1 / B_g weight would be wrong
    _assert_groups_agree(run)
    _assert_one_device(run, clipped=True)

    log = ReplayLog.read(run)
    log.steps.update({2: [0], 3: [0], 5: [1]})
    crafted = tmp_path / "crafted"
    crafted.mkdir()
    log.write(crafted / "committed.jsonl")
    replay = tmp_path / "replay"
    again = ft.run_ft(replay, STEPS, ["--ft-replay", str(crafted)], settings=settings, env={"PLAIT_FT_TIMEOUT_S": "60"})
    assert again.returncode == 0, again.stderr[-3000:]
    assert ReplayLog.read(replay).steps == log.steps  # the replay's own log: the groups that counted
    _assert_groups_agree(replay)
    _assert_one_device(replay, clipped=True)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.cli
@pytest.mark.timeout(600)
def test_moe_aux_free_biases_under_ft_equal_one_device(instructions, tmp_path):
    """aux_free balancing, unclipped, ZeRO-3: every group moves its biases by the loads summed over the quorum in
    the commit's exchange, so the biases equal one device's bitwise."""
    settings = _settings(instructions, "layout.zero=3", "model.moe_balance=aux_free", "model.bias_update_rate=0.01") + [
        "train.max_grad_norm=0"
    ]
    run = tmp_path / "run"
    done = ft.run_ft(run, STEPS, settings=settings, env={"PLAIT_FT_TIMEOUT_S": "60"})
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_groups_agree(run)
    _assert_one_device(run, clipped=False)
    biases = [v for k, v in _final(run, 0).items() if k.endswith("expert_bias")]
    assert biases and all(b.abs().max() > 0 for b in biases)  # the biases moved


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.cli
@pytest.mark.timeout(600)
def test_fp16_under_ft_keeps_hsdp_loss_scale_trajectory(tmp_path):
    """fp16 with an MoE model: every group unscales and checks the combined gradient, so both groups skip the same
    steps and keep one scale, and with as many scored tokens per group (the addition task) each rank's backward
    starts from HSDP's seed S D / N: the same overflow (step 2 here), the same scale, the same updates."""
    settings = [*MOE, "data.name=addition", "layout.zero=2", "layout.precision=fp16", "train.max_grad_norm=0.5"]
    runs = {True: tmp_path / "ft", False: tmp_path / "hsdp"}
    for fault_tolerant, out in runs.items():
        done = ft.run_ft(out, 10, settings=settings, fault_tolerant=fault_tolerant, env={"PLAIT_FT_TIMEOUT_S": "60"})
        assert done.returncode == 0, done.stderr[-3000:]
    records = ft.step_records(runs[True], 0)
    hsdp = {}
    for line in (runs[False] / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "train":
            hsdp[record["step"]] = record
    assert [records[s]["loss_scale"] for s in records] == [hsdp[s]["loss_scale"] for s in hsdp]
    assert [records[s]["skipped"] for s in records] == [hsdp[s]["skipped"] for s in hsdp]
    assert any(r["skipped"] for r in records.values())  # the trajectory holds an overflow
    for step, record in records.items():
        assert abs(record["loss"] - hsdp[step]["loss"]) < FP16_ATOL, step
    ft_state, hsdp_state = _final(runs[True], 0), load_full_state(runs[False] / "ckpt")[0]
    for name, value in hsdp_state.items():
        torch.testing.assert_close(ft_state[name], value, rtol=FP16_RTOL, atol=FP16_ATOL, msg=name)
    zero, one = ft.step_records(runs[True], 0), ft.step_records(runs[True], 1)
    assert all(zero[s]["loss_scale"] == one[s]["loss_scale"] for s in zero)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.cli
@pytest.mark.timeout(900)  # a run with a restart and its replay: ~2 min on 2 busy cores
@pytest.mark.long  # make test-ft: a kill variant (tests/test_ft.py kills in CI)
def test_a_killed_rank_of_an_moe_job_heals_its_biases_and_the_run_replays_bitwise(instructions, tmp_path):
    """tests/test_ft.py's kill, on an MoE model with aux-free biases: group 1 loses a rank at step 4, group 0 trains
    alone (its own balance weights and statistics), group 1 heals (biases included) and rejoins; every replica
    ends bitwise equal, and the replay of the committed log gives the same bits."""
    steps, run = 100, tmp_path / "run"
    settings = _settings(instructions, "layout.zero=2", "model.moe_balance=aux_free", "model.bias_update_rate=0.01")
    settings += ["train.max_grad_norm=0.5"]
    kill = {"PLAIT_FT_FAULT_GROUP": "1", "PLAIT_FAULT_INJECT": "rank=1,step=4,action=kill"}
    slow = {"PLAIT_FT_STEP_DELAY_S": "0.3", "PLAIT_FT_REJOIN_DELAY_S": "5"}  # group 1 back well after the stall
    done = ft.run_ft(run, steps, settings=settings, env={**kill, **slow})
    assert done.returncode == 0, done.stderr[-3000:]
    assert [s["attempt"] for s in ft.starts(run, 0)] == [0, 0]
    assert sorted(s["attempt"] for s in ft.starts(run, 1)) == [0, 0, 1, 1]
    records, healed = ft.step_records(run, 0), ft.step_records(run, 1)
    assert records[4]["ft_groups"] == [0] and records[steps]["ft_groups"] == [0, 1]
    joined = min(s for s in healed if s > 4)
    assert "ft_healed_from_step" in healed[joined]
    assert all(records[s]["moe"] == healed[s]["moe"] for s in healed)  # one table: the quorum's
    final = [_final(run, g) for g in (0, 1)]
    assert all(torch.equal(final[0][name], final[1][name]) for name in final[0])

    replay = tmp_path / "replay"
    again = ft.run_ft(replay, steps, ["--ft-replay", str(run)], settings=settings)
    assert again.returncode == 0, again.stderr[-3000:]
    replayed = _final(replay, 0)
    assert all(torch.equal(replayed[name], final[0][name]) for name in final[0])
    assert [r["moe"] for r in ft.step_records(replay, 0).values()] == [r["moe"] for r in records.values()]
    # one device on the committed rows: fp32 rounding over 100 steps (measured: parameters 4.8e-7, losses 7e-7, norms
    # 1.1e-6 apart; the same tokens routed to every expert at every step, the same biases)
    _assert_one_device(run, clipped=True, steps=steps, loss_atol=5e-6, param_atol=5e-6, norm_rtol=1e-5)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.cli
@pytest.mark.timeout(900)  # a run with a spare and a fault-free run: ~2 min on 2 busy cores
def test_a_spare_of_an_moe_job_adds_zeros_and_takes_a_lost_slot_bitwise(instructions, tmp_path):
    """tests/test_ft.py's spare, on an MoE model (groups of one rank: three processes): the spare sends (0, 0) to
    the balance exchange and zeros to the statistics while it waits, then trains group 1's slot; the run equals
    the fault-free job without a spare bitwise: parameters, every step's loss and routing statistics."""
    steps, run = 60, tmp_path / "run"
    settings = [s for s in _settings(instructions, "layout.zero=2", "model.aux_loss_coef=0.1") if "ep=" not in s]
    kill = {"PLAIT_FT_FAULT_GROUP": "1", "PLAIT_FAULT_INJECT": "rank=0,step=4,action=kill"}
    env = {**kill, "PLAIT_FT_STEP_DELAY_S": "0.2", "PLAIT_FT_TIMEOUT_S": "60", "PLAIT_FT_REJOIN_DELAY_S": "5"}
    done = ft.run_ft(run, steps, ["--ft-spares", "1"], env=env, nproc=2, settings=settings)
    assert done.returncode == 0, done.stderr[-3000:]
    records, spare = ft.step_records(run, 0), ft.step_records(run, 2)
    assert all(r["ft_groups"] == [0, 1] for r in records.values())
    assert spare[1]["ft_slot"] is None and spare[4]["ft_slot"] == 1  # the spare took slot 1 at the fault's step
    clean = tmp_path / "clean"
    again = ft.run_ft(clean, steps, nproc=2, settings=settings, env={"PLAIT_FT_TIMEOUT_S": "60"})
    assert again.returncode == 0, again.stderr[-3000:]
    reference, final = _final(clean, 0), _final(run, 0)
    assert all(torch.equal(reference[name], final[name]) for name in final)
    fault_free = ft.step_records(clean, 0)
    assert [(r["loss"], r["moe"]) for r in fault_free.values()] == [(r["loss"], r["moe"]) for r in records.values()]


# ----------------------------------------------------------------- the pieces, in one process


class _Quorum:
    """A stand-in for the quorum's Comm: the other groups' rows (by row width) around this rank's, in group order."""

    device = torch.device("cpu")

    def __init__(self, before: list[torch.Tensor], after: list[torch.Tensor], fail: bool = False) -> None:
        self.before, self.after, self.fail = before, after, fail

    def all_gather(self, tensor, axis, async_op=False):
        if self.fail:
            raise RuntimeError("peer gone")
        width = tensor.numel()
        rows = [r for r in self.before if r.numel() == width] + [tensor] + [r for r in self.after if r.numel() == width]
        out = torch.cat([r.to(tensor.dtype) for r in rows])

        class Done:
            def wait(self):
                return out

        return Done() if async_op else out

    def size(self, axis):
        return 2  # the group's own data ranks (RouterStats' G)


def _router_stats(comm: _Quorum) -> tuple[RouterStats, list[SimpleNamespace]]:
    """A RouterStats over two fake local layers and this stand-in's G = 2 (no model, no collectives of its own)."""
    stats = object.__new__(RouterStats)
    layers = [SimpleNamespace(aux_grad_scale=None, layer=1), SimpleNamespace(aux_grad_scale=None, layer=3)]
    stats.plan, stats.comm, stats.local, stats.rows, stats.axes = None, comm, layers, {1: 0, 3: 1}, []
    return stats, layers


def _engine(stats: RouterStats, tokens: int, step: int = 0) -> SimpleNamespace:
    loss = object.__new__(TokenMeanStep)
    loss.counts = torch.tensor([tokens])
    return SimpleNamespace(experts=stats, step_loss=loss, step=step)


@pytest.mark.parametrize("counted", [True, False])
def test_the_balance_loss_is_weighed_by_the_quorums_tokens_and_sequences(counted):
    """Group 0 scores 30 tokens in 4 sequences, group 1 90 in 4: each scales its balance gradient by
    G x N / (N_g B) x S (one device: 1 / B), not the engine's G / B_g; a group that does not count sends zeros."""
    other = torch.tensor([90.0, 4.0], dtype=torch.float64)
    comm = _Quorum([], [other])
    stats, layers = _router_stats(comm)
    engine = _engine(stats, 30)
    errors = []
    experts = QuorumExperts(engine, comm, lambda step: counted, errors.append)
    assert engine.experts is experts
    experts.begin(4, 8.0)
    if counted:
        assert experts.sequences == 8
        assert all(layer.aux_grad_scale == pytest.approx(2 * 120 / (30 * 8) * 8.0, rel=1e-15) for layer in layers)
    else:  # a replay's left-out group: the totals are the counted groups', its own balance gradient 0
        assert experts.sequences == 4 and all(layer.aux_grad_scale == 0.0 for layer in layers)
    assert not errors
    experts.detach()
    assert engine.experts is stats


def test_a_failed_balance_exchange_is_reported_and_the_step_runs_on_its_own_weights():
    comm = _Quorum([], [], fail=True)
    stats, layers = _router_stats(comm)
    errors = []
    experts = QuorumExperts(_engine(stats, 30), comm, lambda step: True, errors.append)
    experts.begin(4, None)
    assert len(errors) == 1 and all(layer.aux_grad_scale == 2 / 4 for layer in layers)


def test_the_commit_exchange_sums_the_callers_statistics_in_group_order():
    """``combine``'s extra rides the row exchange: summed in slot order (here slot 1's row arrives first)."""
    mine, theirs = torch.tensor([1.0, 2.0]), torch.tensor([3.0, -1.0])
    table = torch.tensor([[5.0, 0.0, 0.25]], dtype=torch.float64)
    their_table = torch.tensor([[7.0, 1.0, 0.5]], dtype=torch.float64)
    head = torch.tensor([1.0, 20.0, 20.0, 1.0, 0.0], dtype=torch.float64)  # slot, w, w L, trained, job code 0
    their_row = torch.cat([head, their_table.view(-1)])
    comm = _Quorum([their_row, theirs * 20.0], [])
    grad = mine.clone()
    done = combine([grad], comm, 0, 10.0, torch.tensor(1.0), extra=table)
    assert done.slots == [0, 1] and torch.equal(done.extra, table + their_table)
    torch.testing.assert_close(grad, (10.0 * mine + 20.0 * theirs) / 30.0)  # fp32 of 2 terms


def test_healing_carries_the_fp16_loss_scale(tmp_path):
    """A healed rank continues with the live group's scale, its good-step count and its skips."""
    config = load_config(None, ["layout.precision=fp16", "model.n_layer=1", "model.d_model=16", "train.out=''"])
    live, _, _ = build(config, World(0, 1, 0, torch.device("cpu"), None))
    healed, _, _ = build(config, World(0, 1, 0, torch.device("cpu"), None))
    live.precision.scaler.scale, live.precision.scaler.good_steps, live.precision.scaler.skipped_steps = 512.0, 7, 3
    load_engine_state(healed, wire.loads(wire.dumps(engine_state(live))), "the live replica group")
    scaler = healed.precision.scaler
    assert (scaler.scale, scaler.good_steps, scaler.skipped_steps) == (512.0, 7, 3)
    fp32, _, _ = build(
        load_config(None, ["model.n_layer=1", "model.d_model=16", "train.out=''"]),
        World(0, 1, 0, torch.device("cpu"), None),
    )
    with pytest.raises(CheckpointError, match="precisions differ"):
        load_engine_state(fp32, wire.loads(wire.dumps(engine_state(live))), "the live replica group")
