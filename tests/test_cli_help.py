"""Every ``plait`` command and subcommand says what it does in ``--help`` (issue 37: ``plait data info`` had no
description, ``plait train --help`` named one preset of two and only "the reference GPT")."""

from __future__ import annotations

import argparse

from plait.cli.main import _parser
from plait.train.presets import DESCRIPTIONS, PRESETS


def _commands(parser: argparse.ArgumentParser, path: str = "plait") -> list[tuple[str, argparse.ArgumentParser, str]]:
    """(command path, its parser, its one-line help) for every subcommand, nested ones included."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                found.append((f"{path} {name}", sub, helps.get(name) or ""))
                found += _commands(sub, f"{path} {name}")
    return found


def test_every_command_has_a_help_line_and_a_description() -> None:
    commands = _commands(_parser())
    assert len(commands) >= 15
    missing = [name for name, sub, line in commands if not line or not (sub.description or "").strip()]
    assert not missing, f"commands without a help line or a description: {missing}"


def test_plait_train_help_names_every_preset_and_every_model_kind() -> None:
    assert set(DESCRIPTIONS) == set(PRESETS)
    train = next(sub for name, sub, _ in _commands(_parser()) if name == "plait train")
    text = train.format_help()
    assert all(name in text for name in PRESETS)
    assert "Hugging Face" in text and "MoE" in text
