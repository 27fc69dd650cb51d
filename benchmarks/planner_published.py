"""The cost model against published training runs: fitted per GPU generation on some tables, reported on others.

    python -m benchmarks.planner_published               # prints the table and the error statistics (~15 s)
    python -m benchmarks.planner_published --write-docs  # and puts them into docs/planner.md

Every row of ``plait/planner/published.py`` (its source, table and what is assumed are recorded there) is predicted
with ``plait.planner.accuracy``: the compute efficiency of each GPU generation is fitted on its fitting rows
(median of the rows' own efficiencies), then in-sample, leave-one-out (fitting rows, each predicted by a fit
without it), out-of-sample (papers never used for fitting) and out-of-table (other tables of a fitting source)
errors are reported side by side, with each layout's predicted memory against its GPU's. Deterministic: no
measurement is taken on this machine.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.report import replace_between
from plait.planner.accuracy import evaluate, fit, markdown

DOC = Path(__file__).resolve().parent.parent / "docs" / "planner.md"
DOC_START, DOC_END = "<!-- planner-published:start -->", "<!-- planner-published:end -->"


def write_docs(text: str, path: Path = DOC) -> None:
    """Replace the block between the published-runs markers of docs/planner.md with ``text``."""
    replace_between(path, DOC_START, DOC_END, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write-docs", action="store_true", help="put the table into docs/planner.md")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    fitted = fit()
    text = markdown(evaluate(fitted=fitted), fitted)
    print(text)
    print(f"\n({time.perf_counter() - started:.0f} s)")
    if args.write_docs:
        write_docs(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
