"""``plait certify`` (docs/certify.md): bad input refused in one line before any process; the budget and the
comparison; plait's GPT and MoE GPT certified equal under layouts over dp, ZeRO-3, tp + SP, pp, cp and ep; and
mutants of plait (tests/helpers/certify_mutants.py) caught and located at the right module."""

from __future__ import annotations

import json

import pytest
import torch

from plait.certification import BITWISE, DIFFERS, EQUAL, CertifyJob, certify, parse_layout
from plait.certification.budget import budget_for, reordered_terms
from plait.certification.compare import diff_tensor
from plait.certification.tape import ROOT, ModuleTape
from plait.cli.main import main
from plait.errors import ConfigError
from plait.layout import Layout
from plait.train.config import load_config

JOB = ["train.global_batch=8", "train.max_grad_norm=0"]
"""The tests' job: the addition task, 8 samples a step; no clipping, so a scale error shows in every gradient."""
MUTANTS = "helpers.certify_mutants"


def _job(layouts: list[str], **kwargs) -> CertifyJob:  # noqa: ANN003
    return CertifyJob(load_config(None, JOB), layouts, **kwargs)


# ----------------------------------------------------------------- bad input: one line, the fix, no process
@pytest.mark.parametrize(
    "layouts, kwargs, words",
    [
        (["tp=2"], {"steps": 0}, "--steps 0 must be a positive integer"),
        (["tp=2"], {"steps": -3}, "--steps -3"),
        (["tp2"], {}, "is not KEY=VALUE"),
        (["tpp=2"], {}, "layout 'tpp=2'"),
        (["tp=2", "dp=4"], {"nproc": 2}, "layout 'dp=4' needs 4 processes, but certify runs 2"),
        (["dp=2", "dp=4"], {}, "layout 'dp=2' needs 2 processes, but certify runs 4"),
        (["dp=3"], {}, "global batch 8 does not split"),
        (["cp=3"], {}, "layout 'cp=3'"),
        (["dp=2"], {"model_factory": "nowhere_at_all:make"}, "cannot import 'nowhere_at_all'"),
        (["dp=2"], {"model_factory": "plait"}, "is not MODULE:FUNCTION"),
        (["dp=2"], {"optimizer_factory": "nowhere_at_all:make"}, "--optimizer 'nowhere_at_all:make': cannot import"),
        (["dp=2"], {"optimizer_factory": "torch:no_such_factory"}, "torch has no function 'no_such_factory'"),
        (["dp=2"], {"model_factory": f"{MUTANTS}:tiny_gpt", "layers": 1}, "cannot set the depth of --model's factory"),
    ],
)
def test_bad_input_is_one_line_with_the_fix(layouts, kwargs, words):
    with pytest.raises(ConfigError) as error:
        _job(layouts, **kwargs).check()
    message = str(error.value)
    assert words in message and "Fix:" in message and "\n" not in message, message


def test_a_hugging_face_model_is_sliced_to_its_first_layers(tmp_path):
    """``--layers`` sets a Hugging Face model's ``num_hidden_layers`` (tests/test_certify_hf.py certifies such a
    slice of a folder's weights); a slice deeper than the model is refused before any process."""
    fields = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 16, "num_attention_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps({**fields, "vocab_size": 16, "max_position_embeddings": 8}))
    config = load_config(None, [*JOB, f"model.hf_config={str(tmp_path / 'config.json')!r}"])
    assert CertifyJob(config, ["dp=2"], layers=2).check().config.model["num_hidden_layers"] == 2
    with pytest.raises(ConfigError, match="has 4 layers, and a slice keeps the first N of them. Fix:"):
        CertifyJob(config, ["dp=2"], layers=5).check()


def test_layouts_resolve_on_the_configured_layout_and_slices_keep_widths():
    job = _job(["tp=2", "dp=2,zero=3", "pp=2,microbatches=2"], layers=2).check()
    assert [layout.world_size for layout in job.resolved] == [2, 2, 2]
    assert job.resolved[0].dp == 1 and job.resolved[1].zero == 3 and job.resolved[2].microbatches == 2
    assert job.config.model["n_layer"] == 2 and job.config.model["d_model"] == 64
    with pytest.raises(ConfigError, match="layout 'pp=2,microbatches=2': the pipeline needs .* 2 stages.*Fix:"):
        _job(["pp=2,microbatches=2"], layers=1).check()  # one block cannot make two stages: refused before any process
    assert parse_layout("tp=2, sequence_parallel=true", Layout()).sequence_parallel is True


def test_cli_refuses_bad_input_with_exit_code_2(capsys):
    assert main(["certify", "--layouts", "dp=2", "--steps", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("plait: error:") and "Fix:" in err and "\n" not in err


# ----------------------------------------------------------------- the budget and the comparison
def test_budget_is_computed_from_the_layout_and_dtype():
    reference = Layout(dp=1)
    assert reordered_terms(Layout(dp=1)) == 1
    assert reordered_terms(Layout(dp=2, tp=2, microbatches=2).resolve(4)) == 8
    fp32 = budget_for(Layout(dp=4).resolve(4), reference, muon=False)
    assert fp32.rel(0) == pytest.approx(2**11 * 4 * 2**-24) and fp32.rel(2) == pytest.approx(3 * fp32.rel(0))
    bf16 = budget_for(Layout(dp=2, precision="bf16").resolve(2), reference, muon=True)
    assert bf16.dtype == "bf16" and bf16.rel(0) == pytest.approx(8 * 2**-8) and bf16.update_rel > 0
    assert "k = 4" in fp32.describe() and "Muon" in bf16.describe()


def test_comparison_tells_bitwise_within_and_outside():
    expected = torch.linspace(-1, 1, 100)
    assert diff_tensor("w", expected.clone(), expected, 1e-6).bitwise
    close = diff_tensor("w", expected * (1 + 1e-7), expected, 1e-6)
    assert not close.bitwise and close.within and close.max_rel <= 1.1e-7
    far = diff_tensor("w", expected * 1.01, expected, 1e-6)
    assert not far.within and far.ratio > 1000 and far.max_abs == pytest.approx(0.01, rel=1e-3)
    noise = torch.full((10,), 1e-9)  # rounding noise: judged against the gradients' typical size (floor)
    assert diff_tensor("b", -noise, noise, 1e-4, floor=1.0).within
    assert not diff_tensor("b", -noise, noise, 1e-4).within


def test_tape_records_modules_innermost_first_and_output_gradients():
    from helpers.certify_mutants import tiny_model

    model = tiny_model()  # not tiny_gpt: it patches the addition task, which this (pytest's) process keeps using
    tape = ModuleTape(model)
    tape.active = True
    tokens = torch.randint(0, 12, (2, 8))
    model(tokens).sum().backward()
    assert tape.forward_order.index("blocks.0.attn.o") < tape.forward_order.index("blocks.0.attn")
    assert tape.forward_order[-1] == ROOT and tape.backward_order[0] in ("lm_head", ROOT)
    (logits_grad,) = tape.grouped("lm_head", True, 1)
    assert torch.equal(logits_grad, torch.ones(2, 8, 12))
    assert tape.grouped("lm_head", False, 2) is None  # one call does not split into two micro-batches
    model(tokens[1:]).sum().backward()  # a second "micro-batch": rows concatenated after the first call's
    assert tape.grouped("lm_head", False, 2)[0].shape == (3, 8, 12)


# ----------------------------------------------------------------- certified equal (processes)
@pytest.mark.distributed
def test_plait_gpt_is_equal_under_six_layouts():
    """dp with micro-batches, ZeRO-3, tp + sequence parallelism, pp (1F1B), cp (ring), Ulysses; uneven rows."""
    layouts = [
        "dp=2,microbatches=2",
        "dp=2,zero=3",
        "tp=2,sequence_parallel=true",
        "pp=2,microbatches=2",
        "cp=2",
        "cp=2,cp_mode=ulysses,zero=1",
    ]
    certificate = certify(None, layouts, steps=3, overrides=JOB, model=f"{MUTANTS}:tiny_gpt")
    verdicts = {result.layout: result.verdict for result in certificate.layouts}
    assert certificate.equal and set(verdicts.values()) <= {BITWISE, EQUAL}, verdicts
    worst = max(d.ratio for r in certificate.layouts for s in r.steps for d in s.grads.values())
    assert worst < 0.5, f"plait's own layouts use up to {worst:.2f} of the gradient budget"


@pytest.mark.distributed
def test_the_docs_job_is_equal_under_zero3_with_context_parallelism():
    """docs/certify.md's first command: plait's GPT with biases, whose key biases' gradients are pure rounding
    noise (a constant added to every key leaves softmax unchanged); Adam turns that noise into steps that differ
    between the runs by up to a full step. Their allowance was the tensor's own largest step, itself noise: the
    job was said to DIFFER at blocks.1.attn.k.bias."""
    job = ["model.n_layer=2", "model.n_head=4", "model.d_model=64"]
    certificate = certify(None, ["dp=2,zero=3,cp=2"], steps=2, overrides=job)
    assert certificate.equal, [(r.layout, r.verdict, r.divergence) for r in certificate.layouts]


@pytest.mark.distributed
def test_moe_gpt_is_equal_under_expert_parallelism():
    certificate = certify(None, ["dp=2,ep=2", "dp=2,ep=2,zero=3"], steps=2, overrides=JOB, model=f"{MUTANTS}:tiny_moe")
    assert certificate.equal, [(r.layout, r.verdict, r.divergence) for r in certificate.layouts]


# ----------------------------------------------------------------- mutants: DIFFERS, at the right module
@pytest.mark.distributed
def test_a_plain_muon_factory_is_certified_under_tp_and_zero3():
    """The user's own ``torch.optim.Muon`` factory (``--optimizer``), which plait adopts under tp and ZeRO (every
    trainable parameter a matrix): equal within the budget, which allows Muon's bf16 Newton-Schulz."""
    certificate = certify(
        None,
        ["tp=2", "dp=2,zero=3"],
        steps=2,
        overrides=JOB,
        model=f"{MUTANTS}:tiny_matrices_gpt",
        optimizer=f"{MUTANTS}:plain_muon",
    )
    assert certificate.equal, [(r.layout, r.verdict, r.divergence) for r in certificate.layouts]
    assert all(r.budget.muon for r in certificate.layouts)


MUON = ['train.optimizer="muon"']


@pytest.mark.distributed
@pytest.mark.parametrize(
    "mutant, layout, extra, module, direction, parameter",
    [
        ("cp_gradients_summed", "cp=2", [], "lm_head", "gradient sync", "lm_head.weight"),
        ("micro_batch_mean", "dp=2,microbatches=2", [], "lm_head", "backward", "lm_head.weight"),
        ("tp_without_all_reduce", "tp=2", [], "blocks.0.attn.o", "forward", "lm_head.weight"),
        ("muon_stepping_slices", "tp=2", MUON, "blocks.0.attn.q", "optimizer step", "blocks.0.attn.q.weight"),
    ],
)
def test_a_mutant_differs_at_the_right_module(mutant, layout, extra, module, direction, parameter):
    """The parameter: the first gradient backward computes (lm_head's), or for an optimizer step that goes wrong,
    the first parameter in the model's order whose value after the step leaves the budget."""
    certificate = certify(None, [layout], steps=2, overrides=[*JOB, *extra], model=f"{MUTANTS}:{mutant}")
    (result,) = certificate.layouts
    divergence = result.divergence
    assert result.verdict == DIFFERS and divergence is not None and divergence.step == 0, divergence
    assert (divergence.module, divergence.direction) == (module, direction), divergence.describe()
    assert divergence.parameter == parameter, divergence.describe()


@pytest.mark.distributed
def test_cli_writes_the_certificate_and_exits_1_on_a_divergence(tmp_path, capsys):
    out = tmp_path / "cert"
    argv = ["certify", *sum((["--set", item] for item in JOB), []), "--steps", "2", "--out", str(out)]
    code = main([*argv, "--layouts", "dp=2", "tp=2", "--model", f"{MUTANTS}:tp_without_all_reduce", "--deterministic"])
    printed = capsys.readouterr().out
    assert code == 1 and "DIFFERS" in printed and "blocks.0.attn.o (forward)" in printed, printed
    data = json.loads((out / "certificate.json").read_text())
    assert data["equal"] is False and data["differs"] == ["tp=2"] and data["deterministic"] is True
    assert [layout["verdict"] for layout in data["layouts"]] == [EQUAL, DIFFERS] or data["layouts"][0][
        "verdict"
    ] == BITWISE
    assert data["layouts"][1]["divergence"]["module"] == "blocks.0.attn.o"
    summary = (out / "summary.md").read_text()
    assert "first module blocks.0.attn.o (forward)" in summary and "Budget: fp32" in summary
    assert (out / "certificate.png").stat().st_size > 10_000


@pytest.mark.distributed
def test_deterministic_certify_reruns_are_bitwise_equal_and_recorded(tmp_path):
    """``--deterministic``: every process (the reference's and each layout's ranks) reports deterministic mode in
    force, certificate.json records it, and a second certify gives the same bits: losses, norms, and every
    gradient's and parameter's difference from the reference."""
    runs = [
        certify(None, ["dp=2"], steps=2, overrides=JOB, model=f"{MUTANTS}:tiny_gpt", deterministic=True)
        for _ in range(2)
    ]

    def bits(certificate):  # noqa: ANN001, ANN202
        (layout,) = certificate.layouts
        diffs = [(n, d.max_abs, d.max_rel) for s in layout.steps for n, d in [*s.grads.items(), *s.params.items()]]
        return certificate.reference["losses"], [(s.loss, s.grad_norm) for s in layout.steps], diffs

    assert bits(runs[0]) == bits(runs[1])
    runs[0].write(tmp_path)
    data = json.loads((tmp_path / "certificate.json").read_text())
    assert data["deterministic"] is True and data["config"]["train"]["deterministic"] is True
    ranks = [data["reference"]["determinism"], *data["layouts"][0]["determinism"]]
    assert len(ranks) == 3 and all(r["deterministic_algorithms"] and r["env"]["NCCL_ALGO"] == "Ring" for r in ranks)
