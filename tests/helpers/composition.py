"""The composition parity matrix: every layout in {dp, tp, pp, cp} with degrees 1 or 2 (16 layouts) x ZeRO stage
in {0, 1, 3}, trained with plait and compared with single-device training on the same global batches.

What a combination must do (checked by tests/test_composition.py and written up in docs/composition.md):
every step's loss, the step-0 synchronised gradients and every parameter after the last step equal the
single-device reference (fp32 tolerances below), with every parameter name held by some rank and every replica of
a parameter (over dp, cp, tp) bitwise identical. Every cell is accepted by ``plait.parallelize`` (none is refused).

The model is plait's reference GPT, tiny: 4 blocks (pp=2 puts 2 on each stage), d_model 16, 4 heads (tp=2 splits
them), the addition task's 8-token sequences (a multiple of 2*cp*tp = 8: zigzag ring chunks for cp=2) and
vocabulary of 12 (split by tp=2), trained 3 steps with AdamW and global-norm clipping; micro-batches 2 when pp > 1.
Its rows score uneven numbers of tokens (``reference.UnevenMasks``: 1 to 4 of the answer's 4 targets), so every
cell also proves the token-mean normalisation over the global batch (a mean of per-rank or per-micro-batch means
would differ by ~1%).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from unittest import mock

import torch
from helpers.reference import Trajectory, UnevenMasks, assert_tensors_close, train_reference

import plait
from plait import Layout
from plait.certification import gather
from plait.data import AdditionTask, ShardedBatches
from plait.models import GPT, GPTConfig
from plait.models.loss import apply_loss

AXES = ("dp", "tp", "pp", "cp")
ZERO_STAGES = (0, 1, 3)
STEPS = 3
GLOBAL_BATCH = 8
CLIP = 0.05
"""Global-norm clipping threshold: below the tiny GPT's gradient norm (~0.3-1), so clipping acts at every step and
the norm must be reduced over every axis that holds different gradients (dp_cp shards, pp stages, tp slices)."""


def optimizer(params):  # noqa: ANN001, ANN201 - a factory, as users pass it
    """AdamW; eps 1e-5 (not 1e-8) so that Adam's g / (sqrt(v) + eps) cannot blow the ~1e-9 reordering noise of a
    near-zero gradient coordinate up to a full lr-sized step (see docs/composition.md, Tolerances)."""
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-5, weight_decay=0.1)


# fp32 tolerances (why: docs/composition.md). Every paradigm here computes the same sums as one device, split
# over ranks or micro-batches and added in another order: a few ulps (~1e-7 relative) per reduction.
LOSS_RTOL = 1e-6
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-6}
"""Clipping divides by the global norm; coordinates near zero carry only absolute error."""
PARAM_TOL = {"rtol": 1e-5, "atol": 1e-6}
"""After 3 AdamW steps of lr 1e-3: atol 1e-6 is 1/1000 of one step."""
NORM_RTOL = 1e-5
"""The global gradient norm before clipping: a square root of a sum of squares over every rank's gradients, added
in another order than on one device (a few ulps); a uniform scale error (x2 for summing over 2 replicas) is 1e5
times larger."""


@dataclass(frozen=True)
class Combo:
    """One cell of the matrix: degrees (1 or 2) of dp, tp, pp, cp and a ZeRO stage."""

    dp: int
    tp: int
    pp: int
    cp: int
    zero: int
    cp_mode: str = "ring"
    """The matrix runs ring attention (zigzag); Ulysses appears in ``EXTRA``."""
    mutant: bool = False
    """A deliberately broken run (``MUTANTS``): gradients summed over the data-parallel replicas instead of
    averaged. The comparison must fail on it, which shows the matrix sees a uniform gradient-scale error."""

    @property
    def name(self) -> str:
        axes = "-".join(f"{axis}{getattr(self, axis)}" for axis in AXES if getattr(self, axis) > 1) or "single"
        mode = "" if self.cp_mode == "ring" else f"-{self.cp_mode}"
        return f"{axes}{mode}-zero{self.zero}" + ("-summing-mutant" if self.mutant else "")

    @property
    def layout_name(self) -> str:
        return self.name.rsplit("-zero", 1)[0]

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def layout(self) -> Layout:
        return Layout(
            dp=self.dp,
            tp=self.tp,
            pp=self.pp,
            cp=self.cp,
            zero=self.zero,
            cp_mode=self.cp_mode,
            microbatches=2 if self.pp > 1 else 1,
        )


ALL_COMBOS = [Combo(*degrees, zero) for degrees in itertools.product((1, 2), repeat=4) for zero in ZERO_STAGES]
"""48 cells: 16 layouts (dp, tp, pp, cp each 1 or 2) x ZeRO 0, 1, 3."""
EXTRA = [Combo(dp=1, tp=2, pp=1, cp=2, zero=0, cp_mode="ulysses")]
"""Outside the matrix, in the default suite: Ulysses under tensor parallelism (each rank's heads/tp heads are
split again over cp), the other context-parallel kernel next to the tp2-cp2 ring cells."""
MUTANTS = [Combo(dp=2, tp=1, pp=1, cp=1, zero=0, mutant=True), Combo(dp=2, tp=1, pp=2, cp=1, zero=3, mutant=True)]
"""Cells with the sum-instead-of-average mutation (DDP, and ZeRO-3 under a pipeline): every other check of the
matrix passes on them (clipping at every step restores the gradients' size), the norm before clipping does not."""
BY_NAME = {combo.name: combo for combo in ALL_COMBOS + EXTRA + MUTANTS}


MAX_WORLD = 8
"""This machine runs at most ~8 processes: the three 16-rank cells (dp2-tp2-pp2-cp2) pass every check of
``parallelize`` (``check_in_one_process``) but are not trained here."""
TRAINABLE = [combo for combo in ALL_COMBOS if combo.world <= MAX_WORLD]
"""45 cells: every layout up to 8 ranks, at each ZeRO stage. plait refuses none of the 48 cells."""

SAMPLE = [
    BY_NAME[name]
    for name in (
        "dp2-zero3",
        "tp2-zero1",
        "pp2-zero1",
        "cp2-zero0",  # world 2: each axis alone
        "dp2-cp2-zero3",
        "tp2-cp2-zero1",
        "tp2-pp2-zero0",
        "dp2-pp2-zero1",  # world 4: pairs of axes
        "dp2-tp2-zero3",
        "dp2-pp2-zero3",  # world 4: ZeRO-3 sharding tp slices, ZeRO-3 gathered per pipeline action
    )
]
"""A test each (the whole matrix is trained and compared too): 10 cells, world <= 4, covering every axis and every ZeRO stage (checked by a test);
among the world-4 pairs, two that no other test file trains (tp x cp, ZeRO-3 x cp), the pipeline with each
partner it accepts (tp, dp with ZeRO-1 and ZeRO-3) and ZeRO-3 over tensor-parallel slices."""


# ----------------------------------------------------------------- model, data, reference
def make_model() -> tuple[GPT, UnevenMasks]:
    """The tiny reference GPT, identically initialised on every rank and in the reference, and its data: the
    addition task with rows scoring uneven numbers of tokens."""
    task = AdditionTask(digits=2, seed=1)  # vocab 12, seq_len 8; targets on the prompt are ignore_index
    torch.manual_seed(1234)
    # bias=False: the key bias's gradient is analytically zero, i.e. pure rounding noise (docs/testing.md)
    config = GPTConfig(vocab_size=task.vocab_size, seq_len=task.seq_len, n_layer=4, n_head=4, d_model=16, bias=False)
    return GPT(config), UnevenMasks(task)


def reference_trajectory() -> Trajectory:
    """Single-device training on each whole global batch (losses, gradients and parameters per step), and
    ``evaluation``: the trained model's loss on the next global batch."""
    model, task = make_model()
    loader = ShardedBatches(task, GLOBAL_BATCH)
    trajectory = train_reference(
        model, [loader.global_batch_at(step) for step in range(STEPS)], optimizer, max_grad_norm=CLIP
    )  # records the norm before clipping at every step
    model.load_state_dict(trajectory.params[-1])
    inputs, targets = loader.global_batch_at(STEPS)
    with torch.no_grad():
        trajectory.evaluation = float(apply_loss(torch.nn.functional.cross_entropy, model(inputs), targets))
    return trajectory


# ----------------------------------------------------------------- one rank's run
def whole_gradients(engine: plait.Engine) -> dict[str, torch.Tensor]:
    """The synchronised gradients of this rank's parameters, whole (ZeRO shards over dp_cp, tp slices over tp,
    expert slices over ep): the library's gather, which ``plait certify`` uses (``plait.certification.gather``)."""
    return gather.whole_gradients(engine)


def whole_parameters(engine: plait.Engine) -> dict[str, torch.Tensor]:
    """This rank's parameters, whole (ZeRO-3's flat shards gathered, tp and ep slices placed as checkpoints place
    them): ``plait.certification.gather``."""
    return gather.whole_parameters(engine)


def train_combo(combo: Combo) -> dict:
    """Train ``combo`` on this rank: the loss per step, the step-0 gradients and the final parameters (whole
    tensors, by the single-device model's names, of the stages this rank holds), and the evaluation loss of the
    trained model on the next batch (forward only: pipeline forward, cp outputs gathered, vocab-parallel loss)."""
    model, task = make_model()
    engine = plait.parallelize(model, combo.layout(), optimizer=optimizer, max_grad_norm=CLIP)
    if combo.mutant:
        _sum_instead_of_average(engine)
    grads: list[dict[str, torch.Tensor]] = []
    engine.before_optimizer_step.append(lambda e: grads.append(whole_gradients(e)) if not grads else None)
    loader = ShardedBatches(task, GLOBAL_BATCH, dp_rank=engine.mesh.index("dp"), dp_size=engine.mesh.size("dp"))
    stats = [engine.train_step(loader.batch_at(step)) for step in range(STEPS)]
    evaluation = engine.evaluate([loader.batch_at(STEPS)]).loss
    return {
        "losses": [s.loss for s in stats],
        "grad_norms": [s.grad_norm for s in stats],
        "grads": grads[0],
        "params": whole_parameters(engine),
        "eval": evaluation,
    }


def _sum_instead_of_average(engine: plait.Engine) -> None:
    """The mutation: after the strategy has averaged the gradients over the dp_cp replicas, multiply them by the
    replica count, as a strategy that summed instead of averaging would leave them."""
    strategy, replicas = engine.strategy, engine.mesh.size("dp") * engine.mesh.size("cp")
    finish = strategy.finish_backward

    def summing_finish_backward() -> None:
        finish()
        torch._foreach_mul_([g for g in strategy.owned_grads() if g is not None], float(replicas))

    strategy.finish_backward = summing_finish_backward  # type: ignore[method-assign]


def train_combos(names: list[str]) -> dict[str, dict]:
    """Every named combination whose world size is this job's, one after another (one process start-up)."""
    world = torch.distributed.get_world_size()
    return {name: train_combo(BY_NAME[name]) for name in names if BY_NAME[name].world == world}


# ----------------------------------------------------------------- comparison
def merge_ranks(per_rank: list[dict[str, torch.Tensor]], what: str) -> dict[str, torch.Tensor]:
    """The union by name of every rank's tensors; replicas (over dp, cp, tp) must be bitwise identical."""
    merged: dict[str, torch.Tensor] = {}
    for rank, tensors in enumerate(per_rank):
        for name, tensor in tensors.items():
            if name in merged:
                assert torch.equal(merged[name], tensor), f"{what}: rank {rank}'s replica of {name} differs"
            merged[name] = tensor
    return merged


def max_errors(per_rank: list[dict], expected: Trajectory) -> dict[str, float]:
    """Worst absolute differences from the reference: loss (any step), step-0 gradient, final parameter."""
    grads = merge_ranks([r["grads"] for r in per_rank], "grads")
    params = merge_ranks([r["params"] for r in per_rank], "params")
    return {
        "loss": max(
            [abs(a - e) for a, e in zip(per_rank[0]["losses"], expected.losses)]
            + [abs(per_rank[0]["eval"] - expected.evaluation)]
        ),
        "grad": max(float((grads[n] - expected.grads[0][n]).abs().max()) for n in grads),
        "param": max(float((params[n] - expected.params[-1][n]).abs().max()) for n in params),
    }


def assert_combo_matches(combo: Combo, per_rank: list[dict], expected: Trajectory) -> None:
    """Losses (the same on every rank), step-0 gradients, final parameters and the evaluation loss equal the
    reference."""
    what = combo.name
    for rank, result in enumerate(per_rank):
        assert result["losses"] == per_rank[0]["losses"], f"{what}: rank {rank} reports another loss"
        assert result["eval"] == per_rank[0]["eval"], f"{what}: rank {rank} reports another evaluation loss"
    for step, (actual, wanted) in enumerate(zip(per_rank[0]["losses"], expected.losses)):
        assert abs(actual - wanted) <= LOSS_RTOL * abs(wanted), f"{what} step {step}: loss {actual!r} != {wanted!r}"
    for step, (actual, wanted) in enumerate(zip(per_rank[0]["grad_norms"], expected.grad_norms, strict=True)):
        assert actual is not None and abs(actual - wanted) <= NORM_RTOL * wanted, (
            f"{what} step {step}: grad norm before clipping {actual!r} != {wanted!r}"
        )
    actual, wanted = per_rank[0]["eval"], expected.evaluation
    assert abs(actual - wanted) <= LOSS_RTOL * abs(wanted), f"{what}: evaluation loss {actual!r} != {wanted!r}"
    grads = merge_ranks([r["grads"] for r in per_rank], f"{what} step-0 grads")
    params = merge_ranks([r["params"] for r in per_rank], f"{what} final params")
    assert params.keys() == expected.params[-1].keys(), (
        f"{what}: parameters on no rank or unknown: {sorted(params.keys() ^ expected.params[-1].keys())}"
    )
    assert_tensors_close(grads, expected.grads[0], f"{what} step 0 grad", GRAD_TOL)
    assert_tensors_close(params, expected.params[-1], f"{what} final param", PARAM_TOL)


# ----------------------------------------------------------------- parallelize's checks, without processes
class ChecksPassed(Exception):
    """Raised in place of building the mesh: ``plait.parallelize`` accepted the layout."""


def check_in_one_process(world: int, layout: Layout, optimizer=optimizer, model=None, **kwargs) -> None:  # noqa: ANN001, ANN003
    """Run ``plait.parallelize``'s checks in this one process as if it were a rank of ``world``: returns when the
    layout is accepted (parallelize reached ``Mesh.build``, where the first process groups would be created),
    raises its LayoutError when refused. A refusal thus provably comes before any collective. ``model``: the
    matrix's GPT unless given; ``kwargs`` go to ``parallelize`` (e.g. ``loss_fn``)."""
    model = model if model is not None else make_model()[0]
    with (
        mock.patch("plait.parallelize.dist.is_initialized", return_value=True),
        mock.patch("plait.parallelize.dist.get_world_size", return_value=world),
        mock.patch("plait.parallelize.Mesh.build", side_effect=ChecksPassed),
    ):
        try:
            plait.parallelize(model, layout, optimizer=optimizer, max_grad_norm=CLIP, **kwargs)
        except ChecksPassed:
            return
    raise AssertionError(f"plait.parallelize({layout.short()}) neither refused the layout nor built a mesh")


def axis_and_zero_coverage(combos: list[Combo]) -> tuple[set[str], set[int]]:
    """The axes at degree 2 and the ZeRO stages that ``combos`` exercise."""
    axes = {axis for combo in combos for axis in AXES if getattr(combo, axis) > 1}
    return axes, {combo.zero for combo in combos}


def markdown_table(outcomes: dict[str, str]) -> str:
    """docs/composition.md's table: one row per layout, one column per ZeRO stage."""
    lines = ["| layout | world | zero=0 | zero=1 | zero=3 |", "|---|---|---|---|---|"]
    layouts = dict.fromkeys(combo.layout_name for combo in ALL_COMBOS)
    for layout in layouts:
        cells = [outcomes[f"{layout}-zero{zero}"] for zero in ZERO_STAGES]
        world = BY_NAME[f"{layout}-zero0"].world
        lines.append(f"| {layout} | {world} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
