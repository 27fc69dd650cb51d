"""The ``plait`` command: one parser, one module per subcommand.

``plait train`` trains (``train.py``: local launch, or the worker under torchrun); ``plait certify`` proves a job
equal under layouts to one process (``certify.py``); ``plait schedule`` simulates
and draws a pipeline schedule in this process (``schedule.py``); ``plait ps`` trains with parameter servers
(``ps.py``); ``plait convert`` moves weights between checkpoints and safetensors (``convert.py``); ``plait
checkpoint verify|list`` checks checkpoints and lists those of a run (``checkpoint.py``); ``plait runs``
shows what a run folder holds (``runs.py``); ``plait
generate`` prints a trained model's continuation of a prompt (``generate.py``); ``plait data`` prepares and
inspects token folders (``data.py``); ``plait plan``,
``plait simulate`` and ``plait calibrate`` are the planner's (``plan.py``). A ``PlaitError`` is printed as
``plait: error: ...`` with exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from plait.cli.certify import add_certify_command, run_certify
from plait.cli.checkpoint import add_checkpoint_command, run_checkpoint
from plait.cli.convert import add_convert_command, run_convert
from plait.cli.data import add_data_command, run_data
from plait.cli.ft import add_lighthouse_command, run_lighthouse
from plait.cli.generate import add_generate_command, run_generate
from plait.cli.plan import PLANNER_COMMANDS, add_planner_commands, run_planner
from plait.cli.ps import add_ps_command, run_ps
from plait.cli.runs import add_runs_command, run_runs
from plait.cli.schedule import add_schedule_command, run_schedule
from plait.cli.train import add_train_command, run_train
from plait.errors import PlaitError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plait", description="Parallel training with every paradigm, in one place.")
    commands = parser.add_subparsers(dest="command", required=True)
    add_train_command(commands)
    add_certify_command(commands)
    add_schedule_command(commands)
    add_ps_command(commands)
    add_convert_command(commands)
    add_checkpoint_command(commands)
    add_runs_command(commands)
    add_generate_command(commands)
    add_data_command(commands)
    add_lighthouse_command(commands)
    add_planner_commands(commands)
    _describe_subcommands(parser)
    return parser


def _describe_subcommands(parser: argparse.ArgumentParser) -> None:
    """Give every subcommand (nested ones too) whose parser has no description its help line as one, so that
    ``plait X Y --help`` always says what Y does."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                line = str(helps.get(name) or "")
                if not (sub.description or "").strip() and line:
                    sub.description = line[0].upper() + line[1:] + ("" if line.endswith(".") else ".")
                _describe_subcommands(sub)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    try:
        if args.command == "train":
            return run_train(args)
        if args.command == "certify":
            return run_certify(args)
        if args.command == "schedule":
            return run_schedule(args)
        if args.command == "ps":
            return run_ps(args)
        if args.command == "lighthouse":
            return run_lighthouse(args)
        if args.command == "convert":
            return run_convert(args)
        if args.command == "checkpoint":
            return run_checkpoint(args)
        if args.command == "runs":
            return run_runs(args)
        if args.command == "generate":
            return run_generate(args)
        if args.command == "data":
            return run_data(args)
        if args.command in PLANNER_COMMANDS:
            return run_planner(args)
    except PlaitError as error:
        print(f"plait: error: {type(error).__name__}: {error}", file=sys.stderr)  # noqa: T201 - CLI output
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
