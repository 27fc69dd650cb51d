"""Hugging Face Mixture-of-Experts models under plait (plait/models/hf_moe.py, docs/expert_parallel.md): Mixtral,
Qwen2-MoE, Qwen3-MoE and OLMoE as transformers 5 builds them (fused 3-D experts), their blocks run as plait MoE
layers with the family's own parameters and names (logits equal to the family's forward), parity with one device
(losses, norms, the sequence-wise balance loss, tokens per expert, gradients, parameters, evaluation) under expert
parallelism alone and composed (ZeRO-1/2/3, micro-batches, cp ring / Ulysses, tp, pp), starved experts and uneven
loss masks, clipped and unclipped (tests/helpers/hf_moe.py); the refusals; the balance loss that splits where HF's
does not; the families' saved per-expert layout read back fused.

Default suite: one process start-up per world size (2 and 4) trains that size's cells; more under ``long``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest
import torch
from helpers.harness import run_distributed
from helpers.hf_moe import FAMILIES, VOCAB, Cell, global_batch, make_config, make_model, reference, train_cells
from helpers.moe import assert_cell_matches

import plait
from plait import Layout, LayoutError

CELLS = [
    # world 2
    Cell("mixtral-ep2", {"dp": 2, "ep": 2}, family="mixtral"),
    Cell(
        "qwen2-ep2-zero1-starved-unclipped", {"dp": 2, "ep": 2, "zero": 1}, family="qwen2_moe", clip=None, starve=True
    ),
    Cell("qwen3-cp2-ep2-ring", {"dp": 1, "cp": 2, "ep": 2}, family="qwen3_moe"),
    Cell("olmoe-ep2-zero2-mb2", {"dp": 2, "ep": 2, "zero": 2, "microbatches": 2}, family="olmoe"),
    # world 4
    Cell("mixtral-dp4-ep2-zero3", {"dp": 4, "ep": 2, "zero": 3}, family="mixtral"),
    Cell("qwen2-dp2-tp2-ep2", {"dp": 2, "tp": 2, "ep": 2}, family="qwen2_moe"),
    Cell("qwen3-dp2-tp2-ep2-zero3-unclipped", {"dp": 2, "tp": 2, "ep": 2, "zero": 3}, family="qwen3_moe", clip=None),
    Cell(
        "qwen3-dp2-pp2-ep2-1f1b", {"dp": 2, "pp": 2, "ep": 2, "microbatches": 2, "schedule": "1f1b"}, family="qwen3_moe"
    ),
    Cell("olmoe-dp2-cp2-ep4-ulysses", {"dp": 2, "cp": 2, "ep": 4, "cp_mode": "ulysses"}, family="olmoe", starve=True),
]
LONG_CELLS = [
    Cell("mixtral-dp2-tp2-ep2-zero1", {"dp": 2, "tp": 2, "ep": 2, "zero": 1}, family="mixtral"),
    Cell(
        "mixtral-dp2-pp2-ep2-zero-bubble",
        {"dp": 2, "pp": 2, "ep": 2, "microbatches": 2, "schedule": "zero-bubble"},
        family="mixtral",
    ),
    Cell(
        "olmoe-dp2-pp2-ep2-gpipe-starved",
        {"dp": 2, "pp": 2, "ep": 2, "microbatches": 2, "schedule": "gpipe"},
        family="olmoe",
        starve=True,
    ),
    Cell("qwen2-dp2-pp2-ep2-zero3", {"dp": 2, "pp": 2, "ep": 2, "microbatches": 2, "zero": 3}, family="qwen2_moe"),
    Cell("qwen2-dp2-cp2-ep2-ring-zero3", {"dp": 2, "cp": 2, "ep": 2, "zero": 3}, family="qwen2_moe"),
    Cell("mixtral-dp4-ep4-unclipped", {"dp": 4, "ep": 4}, family="mixtral", clip=None),
    Cell("qwen3-ep2-recompute-full", {"dp": 2, "ep": 2, "recompute": "full"}, family="qwen3_moe"),
    Cell("olmoe-ep2-zero3-offload-cpu", {"dp": 2, "ep": 2, "zero": 3, "offload": "cpu"}, family="olmoe"),
    Cell("qwen2-dp2-tp2-pp2-ep2", {"dp": 2, "tp": 2, "pp": 2, "ep": 2, "microbatches": 2}, family="qwen2_moe"),
]
BY_NAME = {cell.name: cell for cell in CELLS + LONG_CELLS}


@functools.cache
def _trained(world: int, long: bool) -> dict[str, list[dict]]:
    """Every cell of ``world`` ranks (of the long list or the default one) in one job: name -> per-rank results."""
    cells = [cell for cell in (LONG_CELLS if long else CELLS) if cell.world == world]
    per_rank = run_distributed(train_cells, world, cells, timeout=600, comm_timeout_s=60)
    return {cell.name: [results[cell.name] for results in per_rank] for cell in cells}


@pytest.mark.distributed
@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.name)
def test_hf_moe_matches_one_device(cell: Cell) -> None:
    assert_cell_matches(cell, _trained(cell.world, False)[cell.name], reference(cell))


@pytest.mark.distributed
@pytest.mark.long
@pytest.mark.parametrize("cell", LONG_CELLS, ids=lambda c: c.name)
def test_hf_moe_matches_one_device_long(cell: Cell) -> None:
    assert_cell_matches(cell, _trained(cell.world, True)[cell.name], reference(cell))


def test_the_cells_exercise_what_they_claim() -> None:
    """Starved cells route no token to experts 2 and 3 (so the second ep rank of ep=2 receives no row); the others
    route to every expert; the balance loss is on."""
    starved = reference(BY_NAME["qwen2-ep2-zero1-starved-unclipped"])
    assert all(row[2] == row[3] == 0 and sum(row) == 2 * 8 * 16 for step in starved["load"] for row in step)
    assert all(v > 0 for step in reference(BY_NAME["mixtral-ep2"])["load"] for row in step for v in row)
    assert reference(BY_NAME["mixtral-ep2"])["aux"][0] > 0.1  # alpha 0.1 x 2 layers x ~1 (balanced: exactly 1)
    assert sorted({cell.family for cell in CELLS}) == sorted(FAMILIES)


# ----------------------------------------------------------------- the adapter (one process)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_adapted_blocks_keep_names_parameters_and_the_family_forward(family: str) -> None:
    """``adapt_hf_moe`` swaps each sparse block for an ``HFMoE`` holding the block's own Parameter objects under the
    same names (state dict unchanged), and the model computes the family's logits and gradients."""
    from plait.models.hf import return_logits
    from plait.models.hf_moe import HFMoE, adapt_hf_moe

    model, original = make_model(family), make_model(family)
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    layers = adapt_hf_moe(model)
    assert [type(m).__name__ for m in layers] == ["HFMoE", "HFMoE"] and [m.layer for m in layers] == [0, 1]
    assert list(model.state_dict()) == keys
    assert all(p is params[name] for name, p in model.named_parameters()) and len(params) == len(keys)
    assert adapt_hf_moe(model) == layers and all(isinstance(m, HFMoE) for m in layers)  # once
    inputs, targets = global_batch(0)
    for module in (model, original):
        return_logits(module)
    for mode in ("eval", "train"):
        torch.testing.assert_close(
            getattr(model, mode)()(inputs), getattr(original, mode)()(inputs), rtol=1e-6, atol=1e-6
        )
    for layer in layers:  # the cross-entropy's gradients (the balance loss off: HF trains none without labels)
        layer.balance = "none"
    for module in (model, original):
        torch.nn.functional.cross_entropy(module(inputs).flatten(0, 1), targets.flatten()).backward()
    for (name, p), q in zip(model.named_parameters(), original.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def test_grouped_kernel_on_the_fused_weights_equals_the_loop() -> None:
    from plait.models.hf_moe import FusedExperts

    experts = FusedExperts(make_model("mixtral").get_submodule("model.layers.0.mlp.experts"))
    rows = torch.randn(10, 32, requires_grad=True)
    counts, grad = torch.tensor([3, 0, 5, 2]), torch.randn(10, 32)  # expert 1 without rows

    def outputs_and_gradients(kernel: str) -> tuple[torch.Tensor, ...]:
        experts.kernel = kernel  # every torch plait supports (>= 2.11) runs _grouped_mm on the CPU too
        out = experts(rows, counts)
        return (out, *torch.autograd.grad(out, [rows, *experts.weights()], grad))

    torch.testing.assert_close(outputs_and_gradients("grouped"), outputs_and_gradients("loop"), rtol=1e-5, atol=1e-6)


def test_balance_loss_settings_follow_the_family_config() -> None:
    """A config asking for a balance loss (output_router_logits) trains plait's with alpha = coef x k / MoE layers;
    none otherwise; ``adapt_hf_moe(balance=..., aux_loss_coef=...)`` overrides."""
    from plait.models.hf_moe import adapt_hf_moe, balance_settings

    assert balance_settings(make_config("mixtral"), 2) == ("aux_loss", pytest.approx(0.1 * 2 / 2))
    assert balance_settings(make_config("olmoe", output_router_logits=False), 2) == ("none", 0.0)
    qwen = make_model("qwen2_moe", decoder_sparse_step=2)  # layer 1 only is MoE (layer 0 a dense MLP)
    (layer,) = adapt_hf_moe(qwen)
    assert (layer.layer, layer.balance, layer.aux_coef) == (1, "aux_loss", pytest.approx(0.1 * 2 / 1))
    assert {m.balance for m in adapt_hf_moe(make_model("qwen3_moe"), balance="none")} == {"none"}
    assert {m.aux_coef for m in adapt_hf_moe(make_model("olmoe"), aux_loss_coef=0.02)} == {0.02}


def test_hf_switch_loss_does_not_split_but_plait_s_sequence_wise_loss_does() -> None:
    """docs/expert_parallel.md: the families' own balance loss (Switch Transformer's, over the whole batch) differs
    when computed on two halves of the batch and averaged, as data parallelism or micro-batches would; plait's
    sequence-wise loss of the same model is the same either way."""
    from plait.models.hf import return_logits
    from plait.models.hf_moe import adapt_hf_moe
    from plait.models.moe import finish_moe_step

    inputs, _ = global_batch(0)
    hf = make_model("mixtral").train()
    with torch.no_grad():
        whole = float(hf(inputs, output_router_logits=True).aux_loss)
        halves = [float(hf(part, output_router_logits=True).aux_loss) for part in inputs.chunk(2)]
    # 4.7e-5 relative here (near-balanced routing at init; it grows with imbalance): 400 times fp32's rounding
    assert abs(sum(halves) / 2 - whole) > 1e-5 * whole
    model = return_logits(make_model("mixtral"))
    adapt_hf_moe(model)
    model.train()

    def plait_aux(batches: list[torch.Tensor]) -> float:
        for batch in batches:
            model(batch)
        return sum(stats.aux_loss for stats in finish_moe_step(model).values())

    assert plait_aux([inputs]) == pytest.approx(plait_aux(list(inputs.chunk(2))), rel=1e-6)


# ----------------------------------------------------------------- plans and refusals (one process)
def _parallelize_checks(world: int, layout: Layout, model: torch.nn.Module) -> None:
    """``plait.parallelize``'s checks as a rank of ``world``, before any collective (``check_in_one_process``)."""
    from helpers.composition import check_in_one_process

    check_in_one_process(world, layout, model=model)


def test_tp_plans_split_attention_shared_experts_and_dense_mlps_only() -> None:
    from plait.models.hf_moe import adapt_hf_moe
    from plait.parallel.tensor.plan import default_plan, resolve_plan

    qwen = make_model("qwen2_moe", mlp_only_layers=[0])  # layer 0: a dense MLP
    adapt_hf_moe(qwen)
    styles = resolve_plan(qwen, default_plan(qwen), tp=2).styles
    assert styles["model.layers.0.mlp"] == "enter" and styles["model.layers.0.mlp.down_proj"] == "rowwise"
    assert "model.layers.1.mlp" not in styles  # the MoE layer is no tp region
    assert styles["model.layers.1.mlp.shared_expert"] == "enter"
    assert styles["model.layers.1.mlp.shared_expert.gate_proj"] == "colwise"
    assert not any(p.endswith((".gate", ".experts", "shared_expert_gate")) for p in styles)
    mixtral = make_model("mixtral")
    styles = resolve_plan(mixtral, default_plan(mixtral), tp=2).styles
    assert styles["model.layers.1.self_attn.k_proj"] == "colwise" and not any(".mlp" in p for p in styles)


@pytest.mark.parametrize(
    ("family", "overrides", "layout", "world", "message"),
    [
        ("olmoe", {}, {"tp": 2}, 2, "OLMoE's q_norm and k_norm normalise q and k over all heads together"),
        ("mixtral", {"router_jitter_noise": 0.1}, {"dp": 2}, 2, r"router_jitter_noise=0.1\) in training"),
        ("mixtral", {"num_local_experts": 6}, {"dp": 4, "ep": 4}, 4, "ep=4 does not divide the 6 experts of model"),
        ("mixtral", {"sliding_window": 8}, {"pp": 2, "microbatches": 2}, 2, "sliding-window attention"),
        ("qwen3_moe", {}, {"tp": 2, "sequence_parallel": True}, 2, "sequence_parallel=True is not supported for Qwen3"),
    ],
)
def test_refusals_name_the_fix_before_any_collective(family, overrides, layout, world, message) -> None:
    with pytest.raises(LayoutError, match=message) as info:
        _parallelize_checks(world, Layout(**layout), make_model(family, **overrides))
    assert "Fix:" in str(info.value)


def test_olmoe_attention_split_by_a_plan_of_the_user_is_refused() -> None:
    from plait.models.hf_moe import adapt_hf_moe
    from plait.parallel.tensor import plan_tensor_parallel

    olmoe = make_model("olmoe")
    adapt_hf_moe(olmoe)
    plan = {"model.layers.*.self_attn": "enter", "model.layers.*.self_attn.q_proj": "colwise"}
    with pytest.raises(LayoutError, match="q_norm and k_norm"):
        plan_tensor_parallel(olmoe, Layout(tp=2).resolve(2), plan)
    plan_tensor_parallel(olmoe, Layout(tp=2).resolve(2), {"lm_head": "colwise_vocab"})  # attention whole: accepted


def test_expert_parallelism_of_other_transformers_models_names_the_families() -> None:
    from transformers import PhimoeConfig, PhimoeForCausalLM

    phimoe = PhimoeForCausalLM(
        PhimoeConfig(hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, num_local_experts=4, vocab_size=VOCAB)
    )  # fmt: skip
    with pytest.raises(LayoutError, match=r"model_type='phimoe'\) has none plait can split.*mixtral, qwen2_moe"):
        _parallelize_checks(2, Layout(dp=2, ep=2), phimoe)
    _parallelize_checks(2, Layout(dp=2), phimoe)  # data parallelism trains it as it is


# ----------------------------------------------------------------- the training program, checkpoints, convert, generate
RUN_TRAIN = {"steps": 3, "global_batch": 8, "save_every": 2, "eval_every": 3, "samples": 1}


def _config_file(folder: Path) -> str:
    """The tiny Qwen2-MoE (a shared expert, a balance loss) as a config.json for ``[model] hf_config``."""
    make_config("qwen2_moe").save_pretrained(str(folder))
    return str(folder / "config.json")


def _train_job(root: str, config_json: str) -> None:
    """``plait train``'s worker on 2 ranks: dp2 x ep2 under ZeRO-1 (each rank 2 of the 4 experts), the addition task,
    a checkpoint at step 2, 3 steps, an evaluation with samples (generation through the exchange) at step 3."""
    from plait.distributed import init
    from plait.train.config import RunConfig
    from plait.train.loop import run

    layout = {"dp": 2, "ep": 2, "zero": 1}
    model = {"hf_config": config_json}
    run(RunConfig.from_dict({"layout": layout, "model": model, "train": {**RUN_TRAIN, "out": root}}), init())


def _resume_job(root: str) -> dict:
    """The run's step-2 checkpoint under ep=1 in one process, then its step 3."""
    from plait.data import ShardedBatches
    from plait.distributed import init
    from plait.train.config import load_config
    from plait.train.loop import build

    config = load_config(Path(root) / "config.toml")
    engine, dataset, _ = build(dataclasses.replace(config, layout=Layout(dp=1)), init())
    engine.load(Path(root) / "ckpt" / "step-00000002")  # not the last step, 3, also saved
    stats = engine.train_step(ShardedBatches(dataset, config.train.global_batch, 0, 1).batch_at(engine.step))
    return {"step": stats.step, "load": stats.moe.load, "loss": stats.loss, "norm": stats.grad_norm}


@pytest.fixture(scope="module")
def hf_moe_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hf_moe")
    run_distributed(_train_job, 2, str(folder / "run"), _config_file(folder), timeout=300)
    return folder / "run"


@pytest.mark.distributed
def test_plait_train_saves_at_ep2_and_resumes_at_ep1_in_one_process(hf_moe_run: Path) -> None:
    records = [json.loads(line) for line in (hf_moe_run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    for record in train:  # the addition task's 8 rows of 8 tokens, top-2: 128 choices per layer and step
        assert record["moe"]["layers"] == [0, 1] and all(sum(row) == 128 for row in record["moe"]["load"])
        assert record["moe"]["aux_loss"] > 0 and record["comm_bytes"]["ep"] > 0
    (resumed,) = run_distributed(_resume_job, 1, str(hf_moe_run), timeout=300)
    wanted = {"step": 3, "load": train[2]["moe"]["load"], "loss": train[2]["loss"], "norm": train[2]["grad_norm"]}
    assert resumed == {
        **wanted,
        "loss": pytest.approx(wanted["loss"], rel=1e-6),
        "norm": pytest.approx(wanted["norm"], rel=1e-5),
    }


@pytest.mark.distributed
def test_convert_to_the_family_s_folder_and_back_and_generate(
    hf_moe_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The checkpoint (experts saved whole from ep slices) becomes a folder in Qwen2-MoE's own per-expert layout
    that ``from_pretrained`` opens with the same weights; the folder converts back to the same tensors; ``plait
    generate`` continues a prompt from the run."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from plait.checkpoint import load_full_state
    from plait.cli.main import main

    whole, _ = load_full_state(hf_moe_run / "ckpt")
    assert whole["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 32, 32)  # saved from [2, 32, 32] slices
    assert main(["convert", str(hf_moe_run / "ckpt"), str(tmp_path / "hf")]) == 0
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as handle:
        on_disk = set(handle.keys())
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in on_disk and not any("gate_up_proj" in k for k in on_disk)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert type(loaded).__name__ == "Qwen2MoeForCausalLM"
    assert all(torch.equal(whole[name], tensor) for name, tensor in loaded.state_dict().items())
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    back, _ = load_full_state(tmp_path / "back")
    assert back.keys() == whole.keys() and all(torch.equal(back[name], whole[name]) for name in whole)
    capsys.readouterr()
    assert main(["generate", str(hf_moe_run), "--prompt", "12+34=", "--max-new-tokens", "3", "--temperature", "0"]) == 0
    text = capsys.readouterr().out.strip()
    assert len(text) == 3 and set(text) <= set("0123456789+=")


FAMILY_UP = {
    "mixtral": "block_sparse_moe.experts.1.w3.weight",
    **{family: "mlp.experts.1.up_proj.weight" for family in ("qwen2_moe", "qwen3_moe", "olmoe")},
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_family_s_saved_per_expert_layout_reads_back_fused(family: str, tmp_path: Path) -> None:
    """``save_pretrained`` writes one tensor per expert (Mixtral: block_sparse_moe.experts.e.w1/w3/w2); plait's own
    reader of HF folders (``plait convert``, ``train.init_from``) stacks them into the model's fused tensors."""
    from safetensors.torch import load_file, save_file

    from plait.errors import ConfigError
    from plait.models.hf_load import read_hf_weights

    model = make_model(family)
    model.save_pretrained(str(tmp_path))
    state = read_hf_weights(tmp_path)
    expected = model.state_dict()
    assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in expected)
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    up = FAMILY_UP[family]  # one expert's up projection missing
    incomplete = {k: v for k, v in on_disk.items() if not k.endswith(f"layers.0.{up}")}
    assert len(incomplete) == len(on_disk) - 1
    save_file(incomplete, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"incomplete set of experts under model.layers.0.mlp.experts"):
        read_hf_weights(tmp_path)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_tracks_fp32(precision: str) -> None:
    """Under autocast the router stays in fp32, the experts' products run in the compute dtype and the outputs are
    added in fp32 (plait's MoE): two steps of Qwen2-MoE (shared expert) in one process, within a few mantissa
    steps of fp32 (losses and balance loss; routing near ties may differ by a token)."""
    from helpers.composition import optimizer

    runs = {}
    for mode in ("fp32", precision):
        engine = plait.parallelize(
            make_model("qwen2_moe"), Layout(precision=mode), optimizer=optimizer, max_grad_norm=0.5
        )
        runs[mode] = [engine.train_step(global_batch(step)) for step in range(2)]
    for full, mixed in zip(runs["fp32"], runs[precision]):
        assert mixed.loss == pytest.approx(full.loss, rel=2e-3) and mixed.moe.aux_loss == pytest.approx(
            full.moe.aux_loss, rel=2e-3
        )
        assert sum(map(sum, mixed.moe.load)) == sum(map(sum, full.moe.load))
