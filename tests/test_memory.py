"""The memory estimator reproduces the ZeRO paper's model-state figures and equals the bytes a run holds."""

import functools

import pytest
import torch
from helpers.gpt import OPTIMIZERS, make_model
from helpers.harness import run_distributed
from helpers.memory import measured_step

import plait
from plait import Layout, estimate_memory, measure_held
from plait.data import ShardedBatches
from plait.models import GPTConfig, ModelSpec
from plait.planner import get_hardware, predict
from plait.planner.activations import Forward, block_bytes
from plait.planner.costs import IMPLEMENTATIONS, block_time, recomputed_blocks
from plait.planner.memory import CUDA_CACHING_OVERHEAD, activation_bytes, zero_paper_bytes
from plait.planner.published import published_runs
from plait.planner.stage_memory import block_activation_bytes, stage_memory


@pytest.mark.parametrize("stage, gigabytes", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_one(stage, gigabytes):
    """Rajbhandari et al. 2020, Figure 1: Psi = 7.5B parameters, N = 64, K = 12."""
    assert zero_paper_bytes(7.5e9, 64, stage) / 1e9 == pytest.approx(gigabytes, abs=0.05)


def test_estimates_fall_as_the_paper_says():
    psi, n = 1000, 4
    by_stage = [estimate_memory(psi, Layout(dp=n, zero=s)) for s in range(4)]
    assert by_stage[0].optimizer_states == 8 * psi and by_stage[1].optimizer_states == 8 * psi / n
    assert by_stage[2].gradients == 4 * psi / n and by_stage[3].parameters == 4 * psi / n
    assert [e.model_states for e in by_stage] == sorted((e.model_states for e in by_stage), reverse=True)
    offloaded = estimate_memory(psi, Layout(dp=n, zero=2, offload="cpu"))
    assert offloaded.host == offloaded.optimizer_states + offloaded.master_weights
    with pytest.raises(ValueError, match="lamb"):
        estimate_memory(psi, Layout(dp=1), optimizer="lamb")


def test_activation_formula_and_recompute():
    full = activation_bytes(seq=2048, batch=1, hidden=4096, heads=32, layers=1)
    assert full == 2048 * 4096 * (34 + 5 * 32 * 2048 / 4096)  # Korthikanti et al. 2022, eq. 2
    assert activation_bytes(2048, 1, 4096, 32, 1, recompute_layers=1) == 2 * 2048 * 4096
    shape = {"seq": 8, "batch": 2, "hidden": 16, "heads": 2, "layers": 2}  # sizes without a vocabulary: blocks only
    estimate = estimate_memory(100, Layout(dp=1, recompute="full"), activations=shape, device="cpu")
    assert estimate.activations == 2 * (4 * 8 * 2 * 16)  # each recomputed block keeps its fp32 input, 4 s b h


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_measured_model_states_equal_the_estimate_single_rank(optimizer):
    model, task = make_model()
    engine = plait.parallelize(model, Layout(), optimizer=OPTIMIZERS[optimizer])
    held = {}
    engine.before_optimizer_step.append(lambda e: held.update(measure_held(e)))
    loader = ShardedBatches(task, 8)
    engine.train_step(loader.batch_at(0))
    engine.train_step(loader.batch_at(1))  # optimizer states exist from the first step on
    estimate = estimate_memory(model, engine.layout, engine.optimizer)
    assert held["parameters"] == estimate.parameters
    assert held["gradients"] == estimate.gradients
    assert held["optimizer_states"] == estimate.optimizer_states


# ------------------------------------------------------------------------------------------ ZeRO 1-3, dp=2 and 4
MEMORY_CONFIGS = [(stage, "none", opt) for stage in (0, 1, 2, 3) for opt in ("adamw", "sgd")] + [
    (1, "cpu", "adamw"),
    (3, "cpu", "adamw"),
    (3, "cpu", "sgd"),
]
"""(zero stage, offload, optimizer): every stage with AdamW (8 B of state per element) and SGD with momentum
(4 B), and offloaded masters under ZeRO-1 and ZeRO-3."""
MEASURE_POINTS = ("backward", "step", "rest")
"""After the last backward returns (before finish_backward), when the optimizer steps, and between steps."""
WITHIN = 0.01
"""Padding: each flat buffer is padded to a multiple of N (at most N-1 elements per bucket / ZeRO-3 unit), a
fraction < 0.2 % of the tiny GPT's 6736 parameters at N <= 4; the issue asks for 1 %."""


def _held_over_steps(world: int) -> dict:
    """For each config, measure_held at the three points of the second step (optimizer state exists by then)."""
    out = {}
    for stage, offload, opt in MEMORY_CONFIGS:
        model, task = make_model()
        psi = sum(p.numel() for p in model.parameters())  # before parallelize: ZeRO-3 empties the model's parameters
        engine = plait.parallelize(model, Layout(dp=world, zero=stage, offload=offload), optimizer=OPTIMIZERS[opt])
        strategy = engine.strategy
        loader = ShardedBatches(task, 8, dp_rank=engine.mesh.index("dp"), dp_size=world)
        for step in range(2):
            inputs, targets = loader.batch_at(step)
            torch.nn.functional.cross_entropy(engine.model(inputs).flatten(0, 1), targets.flatten()).backward()
            held = {"backward": measure_held(engine)}
            strategy.finish_backward()
            held["step"] = measure_held(engine)
            strategy.step()
            strategy.zero_grad()
            held["rest"] = measure_held(engine)
        estimate = estimate_memory(psi, engine.layout, engine.optimizer)
        out[(stage, offload, opt)] = {"held": held, "estimate": estimate}
        getattr(strategy, "close", lambda: None)()
    return out


@functools.cache
def held_over_steps(world: int) -> list[dict]:
    return run_distributed(_held_over_steps, world, world)


def _close(measured: int, estimated: float, what: str) -> None:
    assert measured == pytest.approx(estimated, rel=WITHIN, abs=0), (
        f"{what}: measured {measured} B, estimate {estimated:.0f} B"
    )


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_estimate_equals_measured_under_zero(world):
    """estimate_memory's per-rank model states equal the bytes each rank's tensors hold, within 1 % (padding):
    parameters, master weights and optimizer states at every point; gradients at their peak (ZeRO-1: the full
    local gradient at the end of backward), ``gradients_at_step`` when the optimizer steps, none between steps."""
    for rank, run in enumerate(held_over_steps(world)):
        for (stage, offload, opt), result in run.items():
            held, estimate = result["held"], result["estimate"]
            tag = f"rank {rank} zero={stage} offload={offload} {opt}"
            for point in MEASURE_POINTS:
                for kind in ("parameters", "master_weights", "optimizer_states"):
                    _close(held[point][kind], getattr(estimate, kind), f"{tag} {kind} at {point}")
            peak = max(held[point]["gradients"] for point in MEASURE_POINTS)
            _close(peak, estimate.gradients, f"{tag} peak gradients")
            _close(held["step"]["gradients"], estimate.gradients_at_step, f"{tag} gradients at the step")
            assert held["rest"]["gradients"] == 0, f"{tag}: gradients held between steps"


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_each_stage_removes_what_the_paper_says(world):
    """Measured: stage 1 divides the optimizer states by N (its gradients peak at the full size during backward),
    stage 2 the gradients too, stage 3 the parameters too (ratios to DDP's figures, 1/N up to padding)."""
    run = held_over_steps(world)[0]
    for opt in ("adamw", "sgd"):
        ddp, *zero = (run[(stage, "none", opt)]["held"] for stage in (0, 1, 2, 3))
        peak = [max(h[p]["gradients"] for p in MEASURE_POINTS) for h in (ddp, *zero)]
        ratios = {  # what: (measured ratio to DDP, expected)
            "stage 1 optimizer states": (
                zero[0]["step"]["optimizer_states"] / ddp["step"]["optimizer_states"],
                1 / world,
            ),
            "stage 1 gradients (peak: full during backward)": (peak[1] / peak[0], 1.0),
            "stage 2 gradients": (peak[2] / peak[0], 1 / world),
            "stage 2 parameters (whole)": (zero[1]["rest"]["parameters"] / ddp["rest"]["parameters"], 1.0),
            "stage 3 parameters": (zero[2]["rest"]["parameters"] / ddp["rest"]["parameters"], 1 / world),
            "stage 3 optimizer states": (
                zero[2]["step"]["optimizer_states"] / ddp["step"]["optimizer_states"],
                1 / world,
            ),
        }
        for what, (ratio, want) in ratios.items():
            assert ratio == pytest.approx(want, rel=WITHIN), f"{opt} {what}: {ratio:.4f}, expected {want:.4f}"


# ------------------------------------------------------------------------------------------ a whole step's peak
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_estimate_equals_measured_per_zero_stage_and_recompute_mode(stage):
    """World 1, plait's GPT in fp32, AdamW: for each recompute mode, the activations one training step keeps for
    backward (SavedActivations over engine.train_step) equal ``estimate_memory(...).activations`` to the byte, and
    the model states held at the optimizer step (measure_held) equal its model-state figures."""
    config = GPTConfig(vocab_size=12, seq_len=8, n_layer=2, n_head=4, d_model=16)
    batch = tuple(torch.randint(0, 12, (4, 8), generator=torch.Generator().manual_seed(i)) for i in (1, 2))
    for recompute in ("none", "selective", "op", "full", (1,)):
        saved, held, estimate = measured_step(config, Layout(zero=stage, recompute=recompute), batch, 4)
        assert saved == estimate.activations, (stage, recompute, saved, estimate.activations)
        for kind in ("parameters", "master_weights", "optimizer_states"):
            assert held[kind] == getattr(estimate, kind), (stage, recompute, kind)
        assert held["gradients"] == estimate.gradients_at_step, (stage, recompute)


H100_MEASURED_GIB = {  # issue 14, "Why": one H100, bf16, the reference GPT, AdamW, one micro-batch per step
    ("small", 16, "none"): 17.1,
    ("small", 16, "full"): 11.8,
    ("medium", 8, "none"): 17.4,
    ("medium", 16, "none"): 29.6,
    ("medium", 8, "full"): 10.1,
    ("medium", 16, "full"): 15.5,
}
"""Peak memory measured by a previous session (not re-measured here: this machine has no GPU); GPT-2 small
(12 x 768, 12 heads) and medium (24 x 1024, 16 heads) shapes, vocabulary 50,304, 1,024 tokens."""
SHAPES = {
    "small": GPTConfig(vocab_size=50304, seq_len=1024, n_layer=12, n_head=12, d_model=768),
    "medium": GPTConfig(vocab_size=50304, seq_len=1024, n_layer=24, n_head=16, d_model=1024),
}


def test_the_peak_matches_the_h100_measurements_of_issue_14():
    """The peak (SDPA flash attention, bf16 autocast, CUDA) is at the loss: model states, every saved activation
    (fp32 norm inputs, per-matmul bf16 input copies, autocast's weight copies, the fp32 log-softmax) and the
    loss's two fp32 gradients of [tokens, V]. Predicted within 1% of each of the six measurements (-0.2 to -0.8%:
    docs/zero.md); the estimator this replaces was off by -77% to +65% on the same figures."""
    for (shape, batch, recompute), measured in H100_MEASURED_GIB.items():
        layout = Layout(precision="bf16", recompute=recompute)
        estimate = estimate_memory(SHAPES[shape], layout, "adamw", activations={"batch": batch}, device="cuda")
        assert estimate.peak_phase == "loss"
        assert estimate.peak / 2**30 == pytest.approx(measured, rel=0.01), (shape, batch, recompute)


def test_phases_and_their_parts():
    """The loss phase adds exactly the loss's gradient buffers (8 s b V in fp32) to the states and saved
    activations; ZeRO-3 adds its gathered root unit and one block; the CUDA allocator's overhead is a fixed share;
    AdamW's foreach temporaries count at the step on CUDA, not on CPU; micro-batches accumulate the gradients."""
    config = SHAPES["small"]
    spec = ModelSpec.from_gpt_config(config)
    base = estimate_memory(config, Layout(precision="bf16"), activations={"batch": 4}, device="cuda")
    parts = base.breakdown
    assert parts["loss_buffers"] == 8 * 4 * 1024 * 50304
    assert base.peak == pytest.approx(sum(parts.values()))
    assert base.reserved == pytest.approx(base.peak * (1 + CUDA_CACHING_OVERHEAD))
    on_cpu = estimate_memory(config, Layout(precision="bf16"), activations={"batch": 4}, device="cpu")
    assert on_cpu.allocator_overhead == 0 and on_cpu.phases["step"] == base.phases["step"] - 4 * spec.parameters
    zero3 = estimate_memory(config, Layout(dp=4, zero=3), activations={"batch": 4}, device="cuda")
    root = spec.embedding_parameters + spec.head_parameters
    assert zero3.breakdown["gathered"] == 4 * (root + spec.block_parameters)
    accumulating = estimate_memory(config, Layout(microbatches=2), activations={"batch": 4}, device="cuda")
    assert accumulating.breakdown["gradients"] == 4 * spec.parameters


def test_recompute_modes_and_block_tuples_are_planned_as_what_they_are():
    """A tuple of blocks is neither "none" nor "full": the estimator recomputes exactly those blocks, the planner's
    stage model the listed blocks of the stage (or their share), and its block time a share of the forward."""
    config = GPTConfig(vocab_size=50304, seq_len=1024, n_layer=4, n_head=12, d_model=768)
    spec = ModelSpec.from_gpt_config(config)
    est = {r: estimate_memory(config, Layout(recompute=r), activations={"batch": 2}).activations for r in
           ("none", "selective", "full", (0, 2))}  # fmt: skip
    fwd = Forward(2, 1024)
    kept = {m: block_bytes(spec, fwd, m) for m in ("none", "full")}
    assert est["none"] - est[(0, 2)] == 2 * (kept["none"] - kept["full"]) == (est["none"] - est["full"]) / 2
    assert est["full"] < est[(0, 2)] < est["selective"] < est["none"]
    impl = IMPLEMENTATIONS["plait"]
    stage = {
        r: stage_memory(spec, Layout(recompute=r), impl, 2, 1024, spec.parameters, 4, 1, True, spec.block_parameters)
        for r in ("none", "full", (0, 2))
    }
    assert stage["full"].activations < stage[(0, 2)].activations < stage["none"].activations
    two_blocks = {  # a stage of blocks 2 and 3 with two micro-batches in flight: only block 2 is listed
        r: stage_memory(
            spec, Layout(recompute=r), impl, 2, 1024, spec.parameters, 2, 2, True, spec.block_parameters, first_block=2
        ).activations
        for r in ("none", (0, 2))
    }
    one = {m: block_activation_bytes(spec, Layout(), 2, 1024, impl, m) for m in ("none", "full")}
    # 2 x (none + full) held, plus block 2's activations again while it is recomputed: one (none - full) less
    assert two_blocks["none"] - two_blocks[(0, 2)] == pytest.approx(one["none"] - one["full"])
    hw = get_hardware("h100")
    times = {
        r: block_time(spec, hw, impl, Layout(recompute=r), 2, 1024).recompute for r in ("full", (0, 2), "selective")
    }
    # a listed block costs a whole forward again; the prediction counts the listed blocks of each stage
    assert times[(0, 2)] == pytest.approx(times["full"]) and 0 < times["selective"] < times["full"]
    assert [recomputed_blocks(Layout(recompute=(0, 2)), a, b) for a, b in ((0, 4), (0, 2), (2, 4), (1, 2))] == [
        2,
        1,
        1,
        0,
    ]


def test_published_layouts_fit_with_selective_recomputation():
    """Narayanan et al. 2021 Table 1's largest shapes (145.6B to 1T on A100-80GB, tp 8, pp 8 to 64), the
    configurations Korthikanti et al. 2022 trained with sequence parallelism and selective recomputation: predicted
    to fit with those, as they ran; without any recomputation or sequence parallelism, predicted not to fit (their
    Figure 1: the tensor-parallel baseline's activations overflow 80 GB at these sizes)."""
    impl = IMPLEMENTATIONS["megatron-2021"]
    table_1 = [row for row in published_runs() if row.source == "megatron-2021-t1"]
    for row in table_1[-4:]:
        for recompute, sp, fits in (("selective", True, True), ("none", False, False)):
            layout = Layout(**{**row.layout.to_dict(), "recompute": recompute, "sequence_parallel": sp})
            result = predict(row.spec, layout, "a100-80gb", row.global_batch, implementation=impl, exact=False)
            assert result.fits == fits, (row.label, recompute, result.memory.device / 2**30)
