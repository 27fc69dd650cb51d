"""Model splitting for the pipeline (plait.parallel.pipeline.split): names unchanged, every parameter in exactly
one stage, the stages chained equal the whole model bitwise, even splits and explicit cuts, a rank's local
model with shared stage views, and clear errors for what cannot be cut."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait import LayoutError
from plait.models import GPT, GPTConfig
from plait.parallel.pipeline.split import local_model, plan_split, split_model
from plait.parallel.recompute import apply_recompute


def make_gpt(n_layer: int = 4) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=16, seq_len=8, n_layer=n_layer, n_head=2, d_model=16))


def test_gpt_stages_keep_names_partition_the_parameters_and_chain_to_the_whole_model():
    model = make_gpt()
    stages = split_model(model, 3)
    names = [[name for name, _ in stage.named_parameters()] for stage in stages]
    everything = [name for stage_names in names for name in stage_names]
    assert sorted(everything) == sorted(name for name, _ in model.named_parameters())  # each exactly once
    assert names[0][:2] == ["tok_embed.weight", "pos_embed.weight"]
    assert {"norm_f.weight", "lm_head.weight"} <= set(names[-1])
    assert [sorted(stage.blocks.keys(), key=int) for stage in stages] == [["0", "1"], ["2"], ["3"]]  # 4 = 2+1+1
    tokens = torch.randint(0, 16, (2, 8))
    hidden = tokens
    for stage in stages:
        hidden = stage(hidden)
    assert torch.equal(hidden, model(tokens))  # the same ops on the same values
    originals = {id(p) for p in model.parameters()}
    assert not any(id(p) in originals for stage in stages for p in stage.parameters()), "stages are copies"
    assert len(model.blocks) == 4 and model.lm_head is not None, "the user's model is untouched"


def test_even_split_and_explicit_cuts():
    model = make_gpt(8)
    assert plan_split(model, 3).bounds == (0, 3, 6, 8)
    assert plan_split(model, 3, cuts=[1, 5]).bounds == (0, 1, 5, 8)
    assert [list(s.blocks.keys()) for s in split_model(model, 3, cuts=[1, 5])] == [
        ["0"],
        ["1", "2", "3", "4"],
        ["5", "6", "7"],
    ]


def test_sequential_keeps_child_names():
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    stages = split_model(seq, 2, cuts=[3])
    assert [list(dict(s.named_children())) for s in stages] == [["0", "1", "2"], ["3", "4"]]
    assert [n for n, _ in stages[1].named_parameters()] == ["4.weight", "4.bias"]
    x = torch.randn(3, 4)
    assert torch.equal(stages[1](stages[0](x)), seq(x))


def test_local_model_of_an_interleaved_rank_shares_parameters_with_its_stage_views():
    model = make_gpt(4)
    plan = plan_split(model, 4)
    local, views = local_model(model, plan, [0, 2])  # pp=2, v=2: rank 0 holds stages 0 and 2
    assert sorted(local.blocks.keys()) == ["0", "2"] and local.lm_head is None and local.tok_embed is not None
    owned = {id(p) for p in local.parameters()}
    assert all(id(p) in owned for view in views for p in view.parameters())
    assert list(views[0].blocks.keys()) == ["0"] and views[1].tok_embed is None and list(views[1].blocks) == ["2"]
    assert sum(1 for view in views for _ in view.parameters()) == sum(1 for _ in local.parameters())


def test_recomputation_applied_before_the_split_runs_on_the_copies():
    model = make_gpt(2)
    apply_recompute(model, "full")
    stage = split_model(model, 2)[1]
    block = stage.blocks["1"]
    assert block.forward.args[0].__self__ is block  # the copy's own forward, not the original block's


def test_too_many_stages_names_both_numbers_and_the_fix():
    with pytest.raises(LayoutError, match=r"pp x virtual_stages = 5 stages, but the model has only 4 blocks.*Fix"):
        plan_split(make_gpt(4), 5)
    with pytest.raises(LayoutError, match=r"3 stages, but the model has only 2 children"):
        plan_split(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), 3)


@pytest.mark.parametrize("cuts", [[2], [2, 2], [0, 2], [2, 4]])
def test_bad_cuts(cuts):
    with pytest.raises(LayoutError, match="cuts=.*Fix"):
        plan_split(make_gpt(4), 3, cuts=cuts)


def test_models_that_cannot_be_cut():
    with pytest.raises(LayoutError, match="not an nn.Sequential.*Fix"):
        plan_split(nn.Linear(2, 2), 2)

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
            self.head = nn.Linear(4, 8, bias=False)
            self.head.weight = self.embed.weight

    # tied embeddings (first and last stage): the last stage holds a copy, as a buffer, not a parameter
    assert plan_split(Tied(), 2).tied == (("embed.weight", "head.weight"),)
    first, last = split_model(Tied(), 2)
    assert "head.weight" not in dict(last.named_parameters()) and "head.weight" in dict(last.named_buffers())
    assert torch.equal(last.head.weight, first.embed.weight) and last.head.weight is not first.embed.weight
    tied_middle = Tied()  # shared by the first stage and a middle one: refused
    tied_middle.layers.append(nn.Linear(4, 4))
    tied_middle.layers[1].weight = tied_middle.layers[0].weight
    with pytest.raises(LayoutError, match="shared by pipeline stages 0 and 1.*only the first and the last.*Fix"):
        plan_split(tied_middle, 3)

    class DirectParameter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))
            self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    with pytest.raises(LayoutError, match="holds parameters directly.*Fix"):
        plan_split(DirectParameter(), 2)
