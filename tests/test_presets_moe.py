"""The ``stdlib-moe`` preset (plait/train/presets.py) and its ``small-moe`` model (plait/models/presets.py): the
``stdlib-lm`` run with a Mixture-of-Experts feed-forward of the dense model's active width. A smoke test: the preset
made small trains a few steps with its experts routed and reported; the full preset's curve against ``stdlib-lm``
is in docs/expert_parallel.md."""

from __future__ import annotations

import json
import math

from plait.models import GPT, GPTConfig
from plait.models.build import model_config
from plait.train.config import load_config
from plait.train.presets import PRESETS, preset


def test_small_moe_has_the_dense_models_active_parameters():
    """8 experts of 256, top-2: a token's feed-forward is 2 x 256 = 512 wide, the dense GELU MLP's 4 d; the totals
    differ by the experts (4 x the feed-forward), the active counts by the router (128 x 8 per block) minus the dense
    MLP's biases (512 + 128 per block)."""
    moe = model_config(preset("stdlib-moe")["model"], 4096, 128)
    dense = model_config(preset("stdlib-lm")["model"], 4096, 128)
    assert (moe.n_experts, moe.top_k, moe.top_k * moe.expert_ffn_dim) == (8, 2, dense.ffn_dim)
    moe_spec, dense_spec = GPT(moe).spec(), GPT(dense).spec()
    assert moe_spec.active_parameters - dense_spec.active_parameters == 4 * (128 * 8 - 512 - 128)
    assert moe_spec.parameters > 1.8 * dense_spec.parameters
    assert {k: v for k, v in PRESETS["stdlib-moe"].items() if k != "model"} == {
        k: v for k, v in PRESETS["stdlib-lm"].items() if k != "model"
    }


def test_stdlib_moe_preset_trains_and_reports_its_experts(tmp_path, monkeypatch):
    from plait.train.loop import run

    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "cache"))
    small = {  # the preset made small: 1 MB of the corpus, a 300-token BPE, a 2-block d = 32 model, 6 steps
        "data.corpus_mb": 1, "data.vocab": 300, "data.seq_len": 32, "model.n_layer": 2, "model.d_model": 32,
        "model.n_head": 2, "model.moe_d_ff": 32, "train.steps": 6, "train.global_batch": 4, "train.eval_every": 6,
        "train.eval_batches": 1, "train.save_every": 6, "train.log_every": 1, "train.out": str(tmp_path / "run"),
    }  # fmt: skip
    config = load_config(None, [f"{key}={json.dumps(value)}" for key, value in small.items()], preset="stdlib-moe")
    assert isinstance(model_config(config.model, 300, 32), GPTConfig)
    summary = run(config)
    assert math.isfinite(summary.eval_loss)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    moe = [r["moe"] for r in records if r["kind"] == "train" and "moe" in r]
    assert len(moe) == 6 and all(m["aux_loss"] > 0 for m in moe)
