"""Layout validation: every bad layout raises LayoutError naming the problem and the fix."""

import pytest

import plait
from plait import Layout, LayoutError
from plait.layout import from_mapping


def test_defaults_resolve_to_data_parallel():
    layout = Layout().resolve(4)
    assert (layout.dp, layout.tp, layout.pp, layout.cp) == (4, 1, 1, 1)
    assert layout.world_size == 4


def test_minus_one_takes_the_rest():
    assert Layout(dp=2, tp=-1).resolve(8).tp == 4
    assert Layout(dp=-1, tp=2, pp=2).resolve(8).dp == 2


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"dp": 0}, ["dp=0", "Fix"]),
        ({"tp": -2}, ["tp=-2", "-1"]),
        ({"dp": -1, "tp": -1}, ["dp and tp", "only one"]),
        ({"zero": 4}, ["zero=4", "0 (off)"]),
        ({"microbatches": 0}, ["microbatches=0", ">= 1"]),
        ({"schedule": "zigzag"}, ["schedule='zigzag'", "1f1b"]),
        ({"precision": "fp8"}, ["precision='fp8'", "bf16"]),
        ({"recompute": "some"}, ["recompute='some'", "block indices"]),
        ({"recompute": (1, -1)}, ["block indices"]),
        ({"bucket_mb": 0}, ["bucket_mb=0", "positive"]),
        ({"bucket_mb": float("inf")}, ["bucket_mb=inf", "positive"]),
        ({"bucket_mb": float("nan")}, ["bucket_mb=nan", "positive"]),
        ({"virtual_stages": 2}, ["virtual_stages=2", "interleaved"]),
        ({"sequence_parallel": True}, ["sequence_parallel", "tp >= 2"]),
        ({"tp": 2.5}, ["tp=2.5", "whole number"]),
    ],
)
def test_bad_fields(kwargs, words):
    with pytest.raises(LayoutError) as info:
        Layout(**kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_product_must_equal_world_size():
    with pytest.raises(LayoutError, match=r"multiply to 8 ranks, but the world size is 4.*dp=-1.*--nproc 8"):
        Layout(dp=2, tp=2, pp=2).resolve(4)


def test_inferred_degree_must_divide():
    with pytest.raises(LayoutError, match="does not divide the world size 6"):
        Layout(dp=-1, tp=4).resolve(6)


def test_world_size_must_be_positive():
    with pytest.raises(LayoutError, match="positive"):
        Layout().resolve(0)


def test_batch_must_split():
    layout = Layout(dp=2, microbatches=4).resolve(2)
    assert layout.check_batch(16) == 2
    with pytest.raises(LayoutError, match="multiple of 8"):
        layout.check_batch(12)


def test_unresolved_layout_has_no_world_size():
    with pytest.raises(LayoutError, match="resolve"):
        _ = Layout().world_size


def test_dict_round_trip_and_unknown_keys():
    layout = Layout(dp=2, tp=2, recompute=[0, 1])
    assert Layout.from_dict(layout.to_dict()) == layout
    with pytest.raises(LayoutError, match=r"layout\.tpp.*layout\.tp"):
        Layout.from_dict({"tpp": 2})
    assert from_mapping(Layout, {"dp": 3}, "layout", LayoutError).dp == 3


def test_unsupported_combination_is_named_before_any_work():
    import torch

    model = torch.nn.Linear(2, 2)
    with pytest.raises(LayoutError, match="offload needs zero"):
        plait.parallelize(model, Layout(offload="cpu"), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))


def test_pipeline_cuts_are_checked_and_round_trip():
    layout = Layout(pp=2, pipeline_cuts=[3])
    assert layout.pipeline_cuts == (3,) and Layout.from_dict(layout.to_dict()) == layout
    assert Layout(pp=2, virtual_stages=2, schedule="interleaved", pipeline_cuts=[1, 2, 3]).pipeline_cuts == (1, 2, 3)
    for cuts, message in (
        ([2, 2], "increasing"),
        ([0], "increasing"),
        ([1, 2], "needs 2"),
        (["a"], "block indices"),
    ):
        with pytest.raises(LayoutError, match=message):
            Layout(pp=2, pipeline_cuts=cuts)
    with pytest.raises(LayoutError, match="pp=1"):
        Layout(pipeline_cuts=[1])
    with pytest.raises(LayoutError, match="needs 4"):  # checked again once a -1 degree is resolved
        Layout(pp=-1, dp=1, pipeline_cuts=[1]).resolve(4)


def test_pipeline_cuts_in_two_places_must_agree():
    import torch

    model = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(4)))
    with pytest.raises(LayoutError, match="one place"):
        plait.parallelize(
            model,
            Layout(pp=2, dp=1, pipeline_cuts=[1]),
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
            pipeline_cuts=[2],
        )
