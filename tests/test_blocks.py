"""One block finder (plait.parallel.blocks) for recomputation, ZeRO-3 units and pipeline cuts: a model whose
blocks live in ``encoder.layer`` (BERT-style), with a deeper decoy container inside each block, is cut the same way
by all three."""

import torch
from torch import nn

from plait.parallel.blocks import find_block_container, find_blocks
from plait.parallel.pipeline.split import find_units
from plait.parallel.recompute import apply_recompute
from plait.parallel.zero.fsdp import group_parameters


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])  # a decoy: deeper than encoder.layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layer:
            x = block(x)
        return x


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.encoder = Encoder()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)))


def test_the_shallowest_named_container_holds_the_blocks():
    model = Model()
    path, container = find_block_container(model)
    assert path == "encoder.layer" and container is model.encoder.layer
    assert [p for p, _ in find_blocks(model)] == ["encoder.layer.0", "encoder.layer.1", "encoder.layer.2"]
    assert find_block_container(nn.Linear(2, 2)) is None and find_blocks(nn.Linear(2, 2)) == []


def test_recompute_zero3_and_pipeline_see_the_same_blocks():
    model = Model()
    blocks = [p for p, _ in find_blocks(model)]
    assert apply_recompute(model, "full") == blocks
    units = group_parameters(model, find_blocks(model))
    assert [name for name in units if name] == blocks  # one ZeRO-3 unit per block, plus the root ""
    assert {n for n, _ in units[""]} == {"embed.weight", "embed.bias", "head.weight", "head.bias"}
    kind, container, names = find_units(model)
    assert (kind, container, names) == ("blocks", "encoder.layer", ["0", "1", "2"])


def test_recomputed_encoder_trains_bitwise_like_the_plain_one():
    torch.manual_seed(0)
    plain = Model()
    recomputed = Model()
    recomputed.load_state_dict(plain.state_dict())
    apply_recompute(recomputed, "full")
    x = torch.randn(5, 4)
    for model in (plain, recomputed):
        model(x).square().sum().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), recomputed.named_parameters()):
        assert torch.equal(a.grad, b.grad), name
