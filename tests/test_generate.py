"""Generation: the reference GPT's key/value cache gives the logits of full recomputation (learned positions and
RoPE with grouped-query attention), sampling is deterministic under a seed, sequences longer than the context are
cropped; a Hugging Face GPT-2 decodes the same with and without its cache; ``plait generate`` prints the same
text from checkpoints of one model saved under dp=2, tp=2 and pp=2; bad input is refused with the fix."""

from __future__ import annotations

import pytest
import torch
from helpers.harness import run_distributed

import plait
from plait import Layout
from plait.cli.main import main
from plait.models import GPT, GPTConfig
from plait.models.generate import GPTCache, generate, gpt_forward_cached, next_token
from plait.train.config import DataConfig, RunConfig

SEQ = 24
TEXT = "the quick brown fox jumps over the lazy dog. " * 8


def tiny_gpt(**overrides: object) -> GPT:
    torch.manual_seed(7)
    fields = {"vocab_size": 256, "seq_len": SEQ, "n_layer": 2, "n_head": 4, "d_model": 32, **overrides}
    return GPT(GPTConfig(**fields)).eval()


@pytest.mark.parametrize(
    "overrides",
    [{}, {"position": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False, "n_kv_head": 2}],
    ids=["gpt2-style", "llama-style-gqa"],
)
def test_kv_cache_equals_full_recomputation(overrides: dict) -> None:
    model = tiny_gpt(**overrides)
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(0))
    full = model(tokens)
    cache = GPTCache()
    pieces = [gpt_forward_cached(model, tokens[:, :5], cache)]  # a prefill of 5, then a chunk of 3, then one by one
    pieces.append(gpt_forward_cached(model, tokens[:, 5:8], cache))
    pieces += [gpt_forward_cached(model, tokens[:, t : t + 1], cache) for t in range(8, SEQ)]
    cached = torch.cat(pieces, dim=1)
    assert cache.length == SEQ
    # fp32: the same products, summed in another order (one query against cached keys): a few ulps
    torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5)
    prompt = tokens[0, :4]
    greedy = [generate(model, prompt, 12, temperature=0.0, use_cache=flag) for flag in (True, False)]
    assert torch.equal(greedy[0], greedy[1])
    sampled = [generate(model, prompt, 12, temperature=1.0, top_k=20, seed=3, use_cache=flag) for flag in (1, 0)]
    assert torch.equal(sampled[0], sampled[1])


def test_sampling_is_deterministic_under_a_seed_and_crops_to_the_context() -> None:
    model = tiny_gpt()
    prompt = torch.tensor([1, 2, 3])
    first = generate(model, prompt, 2 * SEQ, temperature=1.0, seed=11)  # longer than the 24 positions
    assert first.shape == (3 + 2 * SEQ,) and torch.equal(first[:3], prompt)
    assert torch.equal(first, generate(model, prompt, 2 * SEQ, temperature=1.0, seed=11))
    assert not torch.equal(first, generate(model, prompt, 2 * SEQ, temperature=1.0, seed=12))
    assert torch.equal(first, generate(model, prompt, 2 * SEQ, temperature=1.0, seed=11, use_cache=False))


def test_next_token_top_k_and_greedy() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0]])
    assert next_token(logits, 0.0, 0, None).item() == 1
    generator = torch.Generator().manual_seed(0)
    draws = {int(next_token(logits, 10.0, 2, generator)) for _ in range(200)}
    assert draws == {1, 2}  # a high temperature spreads the draws, top-k keeps them among the 2 likeliest
    with pytest.raises(ValueError, match="must be >= 0"):
        next_token(logits, -1.0, 0, None)


def test_hf_gpt2_decodes_the_same_with_its_cache() -> None:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config).eval()
    prompt = torch.tensor([5, 6, 7])
    cached = generate(model, prompt, 20, temperature=0.0)  # crosses the 16 positions: cropped, cache rebuilt
    assert cached.shape == (23,)
    assert torch.equal(cached, generate(model, prompt, 20, temperature=0.0, use_cache=False))


# ------------------------------------------------------------------ plait generate from checkpoints of any layout
LAYOUTS = {"dp2": Layout(dp=2), "tp2": Layout(tp=2), "pp2": Layout(pp=2)}


def _save_under_layouts(root: str) -> None:
    for name, layout in LAYOUTS.items():
        engine = plait.parallelize(tiny_gpt(), layout, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
        engine.save(f"{root}/{name}/ckpt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("generate")
    text = root / "text.txt"
    text.write_text(TEXT)
    run_distributed(_save_under_layouts, 2, str(root), timeout=120)
    config = RunConfig(data=DataConfig(name="bytes", path=str(text), seq_len=SEQ))
    for name in LAYOUTS:
        (root / name / "config.toml").write_text(config.dumps())
    return root


@pytest.mark.distributed
def test_plait_generate_is_identical_from_dp2_tp2_pp2_checkpoints(runs, capsys) -> None:
    outputs = {}
    for name in LAYOUTS:
        argv = ["generate", str(runs / name), "--prompt", "the quick", "--max-new-tokens", "30", "--seed", "5"]
        assert main(argv) == 0
        outputs[name] = capsys.readouterr().out
    assert outputs["dp2"] == outputs["tp2"] == outputs["pp2"]
    expected = generate(tiny_gpt(), torch.tensor(list(b"the quick")), 30, temperature=0.8, seed=5)
    assert outputs["dp2"].rstrip("\n") == bytes(expected[9:].tolist()).decode("utf-8", errors="replace")
    step_folder = runs / "pp2" / "ckpt" / "step-00000000"
    assert main(["generate", str(step_folder), "--prompt", "the quick", "--max-new-tokens", "30", "--seed", "5"]) == 0
    assert capsys.readouterr().out == outputs["pp2"]  # one step folder of the checkpoint works too
    assert main(["generate", str(runs / "pp2"), "--prompt", "the quick", "--max-new-tokens", "30", "--seed", "6"]) == 0
    assert capsys.readouterr().out != outputs["pp2"]  # another seed, another text


@pytest.mark.distributed
def test_plait_generate_refuses_bad_input(runs, tmp_path, capsys) -> None:
    assert main(["generate", str(tmp_path), "--prompt", "x"]) == 2
    assert "holds no plait checkpoint" in capsys.readouterr().err
    assert main(["generate", str(runs / "dp2"), "--prompt", ""]) == 2
    assert "--prompt is empty" in capsys.readouterr().err
    assert main(["generate", str(runs / "dp2"), "--prompt", "x", "--temperature", "-1"]) == 2
    assert "must be >= 0" in capsys.readouterr().err
    lonely = tmp_path / "lonely"
    (runs / "dp2" / "ckpt").rename(lonely)
    try:
        assert main(["generate", str(lonely), "--prompt", "x"]) == 2
        assert "no config.toml" in capsys.readouterr().err
    finally:
        lonely.rename(runs / "dp2" / "ckpt")
