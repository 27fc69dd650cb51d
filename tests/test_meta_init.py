"""Models built on the meta device (issue 25): materialised with bitwise the values of eager construction under the
same seed, each rank only its share, and trained exactly like the eagerly built model.

Part 1, one process: a recorded construction replayed (``deferred_init``) and a model built under
``torch.device("meta")`` (its record derived) give bitwise the tensors of eager construction -- plait's GPT (whose
constructor draws for every nn.Linear / nn.Embedding before ``reset_parameters`` draws again, twice for attn.o and
mlp.down), Hugging Face GPT-2 and Llama (``post_init`` -> ``_init_weights``: tied embeddings, a padding row,
RoPE buffers) and any module with ``reset_parameters`` -- and leave the CPU generator where eager construction
leaves it; the replay holds about one tensor at a time; what cannot be initialised is named before any collective.

Part 2, gloo ranks: a GPT built on meta (recorded and derived) trains bitwise like the eager one under dp x ZeRO-3,
tp (with a padded vocabulary), pp, interleaved pp and dp x tp x pp; HF Llama and GPT-2 likewise.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from helpers.harness import run_distributed
from helpers.startup import whole_parameters
from torch import nn

import plait
from plait import Layout, LayoutError
from plait.data import AdditionTask, ShardedBatches
from plait.models import GPT, GPTConfig
from plait.parallel.materialize import MaterializeError, deferred_init, materialize_module
from plait.parallel.materialize.derive import init_record
from plait.parallel.materialize.record import module_tensors
from plait.parallel.materialize.replay import plan_replay

transformers = pytest.importorskip("transformers")
LLAMA_SWITCHES = {"norm": "rmsnorm", "mlp": "swiglu", "position": "rope"}

GPT2_STYLE = dict(vocab_size=50, seq_len=16, d_model=32, n_layer=2, n_head=4)
GPT_CONFIGS = {
    "gpt2-style": GPT2_STYLE,
    "llama-style": {**GPT2_STYLE, "n_layer": 3, "n_kv_head": 2, "bias": False, **LLAMA_SWITCHES},
}


def hf_config(kind: str, **overrides: object) -> object:
    if kind == "gpt2":
        fields = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2Config(**{**fields, **overrides})
    fields = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=16, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.LlamaConfig(**{**fields, **overrides})


class Mixed(nn.Module):
    """A user's module: torch layers, a custom parameter set in reset_parameters (normal_ then clamped), a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8, padding_idx=0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 8))
        self.scale = nn.Parameter(torch.empty(8))
        self.register_buffer("steps", torch.zeros(()))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.scale, std=0.5).clamp_(-0.5, 0.5).mul_(2)
        nn.init.zeros_(self.steps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.embed(x)) * self.scale


BUILDERS = {
    **{f"GPT {name}": (lambda fields=fields: GPT(GPTConfig(**fields))) for name, fields in GPT_CONFIGS.items()},
    "HF GPT-2": lambda: transformers.GPT2LMHeadModel(hf_config("gpt2")),
    "HF Llama": lambda: transformers.LlamaForCausalLM(hf_config("llama")),
    "HF Llama tied, padding row": lambda: transformers.LlamaForCausalLM(
        hf_config("llama", tie_word_embeddings=True, pad_token_id=3)
    ),
    "a module with reset_parameters": Mixed,
}


def tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor for name, (_, tensor) in module_tensors(model).items()}


def eager(build, seed: int = 7) -> tuple[nn.Module, torch.Tensor]:  # noqa: ANN001
    torch.manual_seed(seed)
    model = build()
    return model, torch.get_rng_state()


def assert_same_tensors(expected: nn.Module, got: nn.Module) -> None:
    want, have = tensors(expected), tensors(got)
    assert set(want) == set(have)
    for name, tensor in want.items():
        assert not have[name].is_meta, name
        assert have[name].dtype == tensor.dtype and torch.equal(have[name], tensor), name


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_recorded_construction_replays_bitwise(kind: str) -> None:
    build = BUILDERS[kind]
    expected, rng_after = eager(build)
    torch.manual_seed(7)
    seeded = torch.get_rng_state()
    model = deferred_init(build)
    assert all(t.is_meta for t in model.parameters())
    assert torch.equal(torch.get_rng_state(), seeded)  # recording draws nothing
    materialize_module(model)
    assert_same_tensors(expected, model)
    assert torch.equal(torch.get_rng_state(), rng_after)  # the generator ends where eager construction leaves it


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_model_built_under_meta_device_replays_bitwise(kind: str) -> None:
    """No record: plait rebuilds GPT / HF models from their config, or calls every reset_parameters."""
    build = BUILDERS[kind]
    expected, rng_after = eager(build)
    torch.manual_seed(7)
    with torch.device("meta"):
        model = build()
    materialize_module(model)
    assert_same_tensors(expected, model)
    assert torch.equal(torch.get_rng_state(), rng_after)


def test_replay_holds_about_one_tensor() -> None:
    """GPT's init writes o/down twice (after a pass over every module): still one tensor alive at a time."""
    config = GPTConfig(vocab_size=512, seq_len=16, d_model=64, n_layer=4, n_head=4)
    model = deferred_init(GPT, config)
    record = init_record(model)
    plan = plan_replay(record, list(record.tensors))
    largest = max(t.numel() * 4 for t in model.parameters())
    total = sum(t.numel() * 4 for t in model.parameters())
    assert plan.peak_bytes <= 2 * largest < total / 4


def test_generator_state_kept_when_it_moved_since_the_recording() -> None:
    """Draws after deferred_init: the replay still gives eager's values and leaves the caller's generator alone."""
    expected, _ = eager(BUILDERS["GPT gpt2-style"])
    torch.manual_seed(7)
    model = deferred_init(BUILDERS["GPT gpt2-style"])
    torch.rand(3)
    state = torch.get_rng_state()
    materialize_module(model)
    assert_same_tensors(expected, model)
    assert torch.equal(torch.get_rng_state(), state)


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))


def test_module_that_cannot_be_initialised_is_named() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), NoReset())
    with pytest.raises(MaterializeError, match=r"cannot initialise 1 \(NoReset\).*1\.weight.*reset_parameters"):
        materialize_module(model)
    torch.manual_seed(0)
    recorded = deferred_init(lambda: nn.Sequential(nn.Linear(4, 4), NoReset()))  # its own code, recorded: fine
    torch.manual_seed(0)
    assert_same_tensors(nn.Sequential(nn.Linear(4, 4), NoReset()), materialize_module(recorded))


class Truncated(nn.Linear):
    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.weight, std=0.02)


def test_init_that_skips_meta_tensors_is_named() -> None:
    """torch's trunc_normal_ returns at once on a meta tensor (and draws a value-dependent count on a real one):
    recorded, the weight would keep torch.empty's memory; plait refuses it, recorded or derived."""
    with pytest.raises(MaterializeError, match=r"cannot initialise 0 \(Truncated\).*0\.weight.*trunc_normal_"):
        materialize_module(deferred_init(lambda: nn.Sequential(Truncated(4, 4))))
    with torch.device("meta"):
        model = nn.Sequential(Truncated(4, 4))
    with pytest.raises(MaterializeError, match=r"cannot initialise 0 \(Truncated\).*trunc_normal_"):
        materialize_module(model)


def test_partly_meta_model_is_refused() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, device="meta"))
    with pytest.raises(MaterializeError, match="partly on the meta device.*0.weight"):
        materialize_module(model)


def test_parallelize_refusals_come_before_any_collective() -> None:
    """One process: the errors are raised where parallelize has built no mesh yet (and so on every rank alike)."""
    optimizer = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    with torch.device("meta"):
        bad = nn.Sequential(nn.Linear(4, 4), NoReset())
    with pytest.raises(MaterializeError, match=r"NoReset"):
        plait.parallelize(bad, Layout(), optimizer=optimizer, device="cpu")
    with pytest.raises(LayoutError, match="weights=.*real device"):
        plait.parallelize(nn.Linear(4, 4), Layout(), optimizer=optimizer, device="cpu", weights=_Nothing())


def refuse_on_every_rank() -> str:
    with torch.device("meta"):
        bad = nn.Sequential(nn.Linear(4, 4), NoReset())
    try:
        plait.parallelize(bad, Layout(dp=2, zero=3), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    except MaterializeError as error:
        return str(error)
    return "no error"


@pytest.mark.distributed
def test_a_module_that_cannot_be_initialised_is_named_on_every_rank() -> None:
    """The refusal comes from the checks before any collective: every rank raises it, none waits for another."""
    for message in run_distributed(refuse_on_every_rank, 2, timeout=120, comm_timeout_s=10):
        assert "cannot initialise 1 (NoReset)" in message


class _Nothing:
    description = "nothing"

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {}

    def read(self, requests: list) -> None:  # noqa: ANN001
        raise AssertionError("never read")


# ----------------------------------------------------------------------------------------------- gloo ranks
STEPS = 3


def gpt_config(vocab: int = 12) -> GPTConfig:
    """The tiny GPT; a vocabulary of 14 makes it a Mixture-of-Experts one (4 experts, top 2, one shared expert,
    every other block), whose expert-parallel slices are materialised at their expert offset."""
    if vocab == 14:
        moe = dict(n_experts=4, top_k=2, n_shared_experts=1, moe_every=2)
        return GPTConfig(vocab_size=vocab, seq_len=8, n_layer=4, n_head=4, d_model=16, bias=True, **moe)
    return GPTConfig(vocab_size=vocab, seq_len=8, n_layer=4, n_head=4, d_model=16, bias=True)


def train_gpt(layout: Layout, vocab: int, how: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses of 3 AdamW steps and the whole parameters after them, for a GPT built ``how``."""
    task = AdditionTask(digits=2, seed=1)
    torch.manual_seed(1234)
    if how == "eager":
        model = GPT(gpt_config(vocab))
    elif how == "recorded":
        model = deferred_init(GPT, gpt_config(vocab))
    else:
        with torch.device("meta"):
            model = GPT(gpt_config(vocab))
    engine = plait.parallelize(model, layout, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), max_grad_norm=0.5)
    loader = ShardedBatches(task, 8, dp_rank=engine.mesh.index("dp"), dp_size=engine.mesh.size("dp"))
    losses = [engine.train_step(batch).loss for _, batch in zip(range(STEPS), loader)]
    return losses, whole_parameters(engine)


def differences(label: str, train: Callable[[str], tuple[list[float], dict[str, torch.Tensor]]]) -> list[str]:
    """What differs between ``train("eager")`` and the meta-built runs (recorded, derived) on this rank."""
    problems = []
    losses, params = train("eager")
    for how in ("recorded", "meta"):
        other_losses, other_params = train(how)
        if other_losses != losses:
            problems.append(f"{label} {how}: losses {other_losses} != {losses}")
        differ = [n for n in params if n not in other_params or not torch.equal(params[n], other_params[n])]
        if differ or set(other_params) != set(params):
            problems.append(f"{label} {how}: parameters {differ[:3]} differ")
    return problems


def gpt_job(cases: list[tuple[Layout, int]]) -> list[str]:
    """Per case, what differs between the eager run and the meta-built ones on this rank ([] when nothing)."""
    return [
        problem
        for layout, vocab in cases
        for problem in differences(layout.short(), functools.partial(train_gpt, layout, vocab))
    ]


@pytest.mark.distributed
def test_meta_gpt_trains_bitwise_like_eager_on_4_ranks() -> None:
    cases = [
        (Layout(dp=4, zero=3), 12),
        (Layout(dp=2, tp=2, zero=3), 12),
        (Layout(tp=4, tp_pad_vocab=True), 13),  # 13 rows over 4 ranks: the padded vocabulary's zero rows
        (Layout(dp=2, pp=2, zero=3, microbatches=2), 12),
        (Layout(pp=2, tp=2, microbatches=4, virtual_stages=2, schedule="interleaved"), 12),
        (Layout(dp=4), 12),
        (Layout(dp=4, zero=3, offload="cpu"), 12),  # the host masters are made from the filled shards
        (Layout(dp=2, cp=2, zero=1), 12),
        (Layout(dp=4, ep=2, zero=3), 14),  # MoE: experts sliced over ep, ZeRO-3 units over edp
        (Layout(dp=2, tp=2, ep=2), 14),
    ]
    for problems in run_distributed(gpt_job, 4, cases, timeout=600):
        assert problems == []


@pytest.mark.distributed
@pytest.mark.slow
def test_meta_gpt_trains_bitwise_like_eager_dp_tp_pp() -> None:
    cases = [
        (Layout(dp=2, tp=2, pp=2, zero=1, microbatches=2), 12),
        (Layout(dp=2, tp=2, pp=2, zero=3, microbatches=2), 12),
    ]
    for problems in run_distributed(gpt_job, 8, cases, timeout=600):
        assert problems == []


def train_hf(kind: str, layout: Layout, how: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    from helpers.hf import global_batch, optimizer

    torch.manual_seed(1234)
    config = hf_config(kind, attn_implementation="eager", **({"tie_word_embeddings": False} if kind == "llama" else {}))
    cls = transformers.GPT2LMHeadModel if kind == "gpt2" else transformers.LlamaForCausalLM
    if how == "eager":
        model = cls(config)
    elif how == "recorded":
        model = deferred_init(cls, config)
    else:
        with torch.device("meta"):
            model = cls(config)
    engine = plait.parallelize(model, layout, optimizer=optimizer, max_grad_norm=0.5)
    dp_rank, dp = engine.mesh.index("dp"), engine.mesh.size("dp")
    losses = []
    for step in range(STEPS):
        inputs, targets = global_batch(step)
        share = inputs.shape[0] // dp
        rows = slice(dp_rank * share, (dp_rank + 1) * share)
        losses.append(engine.train_step((inputs[rows], targets[rows])).loss)
    return losses, whole_parameters(engine)


def hf_job(cases: list[tuple[str, Layout]]) -> list[str]:
    return [
        problem
        for kind, layout in cases
        for problem in differences(f"{kind} {layout.short()}", functools.partial(train_hf, kind, layout))
    ]


@pytest.mark.distributed
def test_meta_hf_llama_and_gpt2_train_bitwise_like_eager() -> None:
    cases = [
        ("llama", Layout(dp=2, tp=2, zero=3)),
        ("gpt2", Layout(dp=2, tp=2, zero=1)),
        ("llama", Layout(dp=2, pp=2, zero=1, microbatches=2)),
        ("gpt2", Layout(dp=4, zero=3)),
    ]
    for problems in run_distributed(hf_job, 4, cases, timeout=600):
        assert problems == []


def test_meta_model_with_grid_tensor_parallelism_refused() -> None:
    from plait.parallelize import plan_meta

    with torch.device("meta"):
        model = GPT(gpt_config())
    with pytest.raises(LayoutError, match="tp_mode='2d'.*1D"):
        plan_meta(model, Layout(tp=4, tp_mode="2d"), None)
