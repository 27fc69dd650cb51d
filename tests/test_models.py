"""Tests of the reference GPT: config validation, shapes, causality, stage composition, rope, init and loss."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.models import GPT, Attention, GPTConfig, RMSNorm, apply_rotary, lm_loss


def tiny_config(**overrides: object) -> GPTConfig:
    """A very small config so that every test runs in milliseconds."""
    fields: dict[str, object] = {"vocab_size": 11, "seq_len": 12, "n_layer": 2, "n_head": 4, "d_model": 16}
    fields.update(overrides)
    return GPTConfig(**fields)  # type: ignore[arg-type]


def random_tokens(config: GPTConfig, batch: int = 3, length: int | None = None, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, length or config.seq_len), generator=generator)


def built(config: GPTConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(config).eval()


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        ({"d_model": 18, "n_head": 4}, ["d_model=18", "n_head=4"]),
        ({"n_kv_head": 3}, ["n_kv_head=3"]),
        ({"position": "alibi"}, ["position", "alibi", "rope"]),
        ({"norm": "batchnorm"}, ["norm", "rmsnorm"]),
        ({"mlp": "relu"}, ["mlp", "swiglu"]),
        ({"dropout": 1.0}, ["dropout=1.0"]),
        ({"dropout": -0.1}, ["dropout=-0.1"]),
        ({"vocab_size": 0}, ["vocab_size=0"]),
        ({"n_layer": -1}, ["n_layer=-1"]),
        ({"d_ff": 0}, ["d_ff=0"]),
        ({"init_std": 0.0}, ["init_std"]),
        ({"position": "rope", "d_model": 12, "n_head": 4}, ["head_dim", "even"]),
    ],
)
def test_config_rejects_bad_values_naming_the_field(overrides: dict[str, object], names: list[str]) -> None:
    with pytest.raises(ValueError) as error:
        tiny_config(**overrides)
    for name in names:
        assert name in str(error.value)


def test_config_derived_sizes_and_presets() -> None:
    assert GPTConfig().ffn_dim == 256 and GPTConfig().head_dim == 16 and GPTConfig().kv_heads == 4
    llama = GPTConfig.llama_style(n_kv_head=2)
    assert (llama.position, llama.norm, llama.mlp, llama.bias) == ("rope", "rmsnorm", "swiglu", False)
    assert llama.ffn_dim == 176  # int(8 * 64 / 3) = 170, rounded up to a multiple of 8
    assert llama.kv_heads == 2
    assert GPTConfig.tiny() == GPTConfig()
    assert GPTConfig(d_ff=100).ffn_dim == 100


def test_config_dict_round_trip_and_unknown_keys() -> None:
    config = GPTConfig.llama_style(n_layer=3)
    assert GPTConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="n_layers.*valid fields.*n_layer"):
        GPTConfig.from_dict({"n_layers": 3})


# ---------------------------------------------------------------- forward


ARCHITECTURES = list(itertools.product(["learned", "rope"], ["layernorm", "rmsnorm"], ["gelu", "swiglu"], [None, 2]))


@pytest.mark.parametrize(("position", "norm", "mlp", "n_kv_head"), ARCHITECTURES)
def test_output_shapes_for_every_architecture(position: str, norm: str, mlp: str, n_kv_head: int | None) -> None:
    config = tiny_config(position=position, norm=norm, mlp=mlp, n_kv_head=n_kv_head, bias=norm == "layernorm")
    model = built(config)
    assert (model.pos_embed is None) == (position == "rope")
    assert isinstance(model.norm_f, RMSNorm if norm == "rmsnorm" else nn.LayerNorm)
    assert model.blocks["0"].attn.k.out_features == config.kv_heads * config.head_dim
    logits = model(random_tokens(config, batch=2, length=7))
    assert logits.shape == (2, 7, config.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_causal_future_tokens_do_not_change_earlier_logits(position: str) -> None:
    config = tiny_config(position=position)
    model = built(config)
    tokens = random_tokens(config)
    changed = tokens.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % config.vocab_size
    before, after = model(tokens), model(changed)
    assert torch.equal(before[:, :7], after[:, :7])
    assert not torch.allclose(before[:, 7:], after[:, 7:])


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_pipeline_stages_compose_to_the_full_model(position: str) -> None:
    config = tiny_config(position=position, n_layer=3, n_kv_head=2)
    full = built(config)
    tokens = random_tokens(config)
    first = copy.deepcopy(full)
    del first.blocks["2"]
    first.norm_f, first.lm_head = None, None
    second = copy.deepcopy(full)
    second.tok_embed, second.pos_embed = None, None
    del second.blocks["0"], second.blocks["1"]
    hidden = first(tokens)
    assert hidden.shape == (3, config.seq_len, config.d_model)
    assert torch.equal(second(hidden), full(tokens))
    full_names = {name for name, _ in full.named_parameters()}
    stage_names = [{name for name, _ in stage.named_parameters()} for stage in (first, second)]
    assert stage_names[0] | stage_names[1] == full_names and not stage_names[0] & stage_names[1]
    assert "blocks.2.attn.q.weight" in stage_names[1]
    assert first.flops_per_token() + second.flops_per_token() == full.flops_per_token()


def test_micro_batches_match_the_full_batch() -> None:
    config = tiny_config(position="rope", mlp="swiglu", norm="rmsnorm")
    model = built(config)
    tokens = random_tokens(config, batch=6)
    split = torch.cat([model(tokens[:2]), model(tokens[2:3]), model(tokens[3:])])
    # Rows never interact, but BLAS may block a matmul differently per batch size, so the summation order (and the
    # last bits of float32) can differ: compare with a tolerance a few hundred ulps wide, not bitwise.
    torch.testing.assert_close(split, model(tokens), rtol=1e-5, atol=1e-6)


def test_explicit_positions_equal_default_positions() -> None:
    for position in ("learned", "rope"):
        config = tiny_config(position=position)
        model = built(config)
        tokens = random_tokens(config)
        length = tokens.shape[1]
        assert torch.equal(model(tokens, torch.arange(length)), model(tokens))
        assert torch.equal(model(tokens, torch.arange(length).expand(3, length)), model(tokens))


def test_rope_on_a_chunk_with_global_positions_equals_the_full_sequence_slice() -> None:
    config = tiny_config(position="rope", n_kv_head=2)
    model = built(config)
    attention = model.blocks["0"].attn
    hidden = model.blocks["0"].norm1(model.tok_embed(random_tokens(config)))
    length, chunk = hidden.shape[1], slice(4, 9)
    chunk_positions = torch.arange(length)[chunk]
    q_full, k_full, _ = attention.project_qkv(hidden, torch.arange(length))
    raw_q = attention.split_heads(attention.q(hidden))
    raw_k = attention.split_heads(attention.k(hidden))
    theta = config.rope_theta
    assert torch.equal(apply_rotary(raw_q[:, :, chunk], chunk_positions, theta), q_full[:, :, chunk])
    assert torch.equal(apply_rotary(raw_k[:, :, chunk], chunk_positions, theta), k_full[:, :, chunk])
    q_chunk, k_chunk, _ = attention.project_qkv(hidden[:, chunk], chunk_positions)
    torch.testing.assert_close(q_chunk, q_full[:, :, chunk], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k_chunk, k_full[:, :, chunk], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(apply_rotary(raw_q[:, :, chunk], torch.arange(5), theta), q_full[:, :, chunk])


def test_rope_preserves_norms_and_relative_scores() -> None:
    generator = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 1, 8, generator=generator), torch.randn(1, 1, 1, 8, generator=generator)

    def score(q_position: int, k_position: int) -> torch.Tensor:
        rotated_q = apply_rotary(q, torch.tensor([q_position]), 10000.0)
        rotated_k = apply_rotary(k, torch.tensor([k_position]), 10000.0)
        return (rotated_q * rotated_k).sum()

    torch.testing.assert_close(apply_rotary(q, torch.tensor([5]), 10000.0).norm(), q.norm())
    torch.testing.assert_close(score(7, 3), score(14, 10))


def test_attention_reads_head_counts_from_shapes_like_a_head_sharded_layer() -> None:
    """Split q/k/v by output rows (heads) and o by input columns into two halves, as tensor parallelism would:
    the two partial outputs must sum to the full attention output, with no change to Attention."""
    config = tiny_config(position="rope", n_kv_head=2)
    attention: Attention = built(config).blocks["0"].attn
    hidden = torch.randn(2, 6, config.d_model, generator=torch.Generator().manual_seed(2))
    positions = torch.arange(6)
    partial_sum = torch.zeros_like(hidden)
    q_rows, kv_rows = attention.q.out_features // 2, attention.k.out_features // 2
    for shard in range(2):
        part = copy.deepcopy(attention)
        for name, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
            full_layer: nn.Linear = getattr(attention, name)
            layer = nn.Linear(config.d_model, rows)
            layer.weight.data = full_layer.weight.data[shard * rows : (shard + 1) * rows].clone()
            layer.bias.data = full_layer.bias.data[shard * rows : (shard + 1) * rows].clone()
            setattr(part, name, layer)
        part.o = nn.Linear(q_rows, config.d_model, bias=shard == 0)
        part.o.weight.data = attention.o.weight.data[:, shard * q_rows : (shard + 1) * q_rows].clone()
        if shard == 0:
            part.o.bias.data = attention.o.bias.data.clone()
        partial_sum += part(hidden, positions)
    torch.testing.assert_close(partial_sum, attention(hidden, positions), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- init, counts, loss


def test_initialisation_is_deterministic_and_gpt2_scaled() -> None:
    config = GPTConfig(n_layer=4, d_model=64)
    first, second, other = built(config, seed=3), built(config, seed=3), built(config, seed=4)
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert not torch.equal(first.blocks["0"].attn.q.weight, other.blocks["0"].attn.q.weight)
    block = first.blocks["1"]
    assert torch.all(block.attn.q.bias == 0) and torch.all(block.norm1.weight == 1)
    assert abs(block.mlp.up.weight.std().item() - 0.02) < 0.002
    assert abs(block.mlp.down.weight.std().item() - 0.02 / 8**0.5) < 0.001
    assert abs(block.attn.o.weight.std().item() - 0.02 / 8**0.5) < 0.001


def test_parameter_count_and_flops_formula() -> None:
    config = tiny_config(bias=False, norm="rmsnorm", mlp="gelu", position="rope")
    model = built(config)
    d, ff, vocab = config.d_model, config.ffn_dim, config.vocab_size
    per_block = 4 * d * d + 2 * d * ff + 2 * d
    assert model.num_parameters() == 2 * vocab * d + config.n_layer * per_block + d
    matmul = 4 * d * d + 2 * d * ff  # per block; embeddings are lookups and norms elementwise: no FLOPs
    forward = config.n_layer * (2 * matmul + 4 * config.seq_len * d) + 2 * d * vocab
    assert model.flops_per_token() == 3 * forward == model.spec().flops_per_token()  # Narayanan et al. 2021, eq. 3


def test_lm_loss_ignores_minus_100_targets() -> None:
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 4, 7, generator=generator)
    targets = torch.tensor([[1, -100, 3, -100], [-100, 6, 0, -100]])
    scored = targets != -100
    expected = F.cross_entropy(logits[scored], targets[scored])
    torch.testing.assert_close(lm_loss(logits, targets), expected)
    perturbed = logits.clone()
    perturbed[~scored] += 100.0
    assert torch.equal(lm_loss(perturbed, targets), lm_loss(logits, targets))


def test_training_step_reduces_loss_on_a_fixed_batch() -> None:
    config = tiny_config(position="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=1)
    model = built(config).train()
    tokens = random_tokens(config, batch=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
