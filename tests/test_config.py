"""RunConfig: TOML load, --set overrides, round trip, and clear errors for bad input."""

import pytest

from plait import ConfigError, LayoutError
from plait.train.config import RunConfig, apply_overrides, load_config, parse_value


def test_defaults_round_trip_through_toml(tmp_path):
    config = RunConfig()
    path = tmp_path / "run.toml"
    path.write_text(config.dumps())
    assert load_config(path) == config


def test_overrides_are_toml_values():
    assert parse_value("2") == 2 and parse_value("1e-3") == 1e-3 and parse_value("[0, 1]") == [0, 1]
    assert parse_value("true") is True and parse_value("notes.txt") == "notes.txt"
    config = load_config(None, ["layout.dp=2", "train.lr=1e-3", "layout.recompute=[]", "data.path=a b.txt"])
    assert config.layout.dp == 2 and config.train.lr == 1e-3 and config.data.path == "a b.txt"
    assert apply_overrides({"a": {"x": 1}}, ["a.y=2"]) == {"a": {"x": 1, "y": 2}}


def test_file_then_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[layout]\ndp = 4\n[train]\nsteps = 7\n[model]\nn_layer = 3\n")
    config = load_config(path, ["train.steps=9"])
    assert (config.layout.dp, config.train.steps, config.model["n_layer"], config.model["d_model"]) == (4, 9, 3, 64)


@pytest.mark.parametrize(
    "overrides, error, words",
    [
        (["layout.tpp=2"], LayoutError, "layout.tp"),
        (["layout.tp=0"], LayoutError, "tp=0"),
        (["train.steps=0"], ConfigError, "train.steps"),
        (["train.lr=-1"], ConfigError, "train.lr"),
        (["optim.lr=1"], ConfigError, "unknown section"),
        (["data.nme=x"], ConfigError, "data.name"),
        (["layout-tp=2"], ConfigError, "section.key=value"),
    ],
)
def test_bad_settings(overrides, error, words):
    with pytest.raises(error, match=words):
        load_config(None, overrides)


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[layout\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_bytes_dataset_needs_a_path():
    with pytest.raises(ConfigError, match="data.path"):
        load_config(None, ["data.name=bytes"]).data.dataset_kwargs()
