"""The cost model against published training runs: fitted per GPU generation on some tables, reported on others.

    python -m benchmarks.planner_published               # prints the tables and the error statistics (~15 s)
    python -m benchmarks.planner_published --write-docs  # and puts them into docs/planner.md

Every row of ``plait/planner/published.py`` (its source, table and what is assumed are recorded there) is predicted
with ``plait.planner.accuracy``: the compute efficiency of each GPU generation is fitted on its fitting rows
(median of the rows' own efficiencies), then in-sample, leave-one-out (fitting rows, each predicted by a fit
without it), out-of-sample (papers never used for fitting) and out-of-table (other tables of a fitting source)
errors are reported side by side, with each layout's predicted memory against its GPU's. The published
Mixture-of-Experts rows (``plait/planner/published_moe.py``) follow in a table of their own, predicted with the same
fitted efficiencies and nothing fitted on them. Deterministic: no measurement is taken on this machine.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.report import replace_between
from plait.planner.accuracy import Scored, error_stats, evaluate, fit, markdown, row_efficiency, table
from plait.planner.published_moe import published_moe_runs

DOC = Path(__file__).resolve().parent.parent / "docs" / "planner.md"
DOC_START, DOC_END = "<!-- planner-published:start -->", "<!-- planner-published:end -->"
MOE_START, MOE_END = "<!-- planner-published-moe:start -->", "<!-- planner-published-moe:end -->"


def write_docs(text: str, path: Path = DOC, start: str = DOC_START, end: str = DOC_END) -> None:
    """Replace the block between the published-runs markers of docs/planner.md with ``text``."""
    replace_between(path, start, end, text)


def _needed(scored: Scored) -> str:
    """The efficiency that meets the row's measurement, or "none" when even 1.0 is too slow."""
    value = row_efficiency(scored.run)
    return "none" if value >= 1.0 and (scored.error or 0.0) < 0 else f"{value:.3f}"


def moe_markdown(scored: list[Scored]) -> str:
    """The MoE table, its errors, and the efficiency each row would need (a diagnostic: nothing uses it)."""
    lines = table(scored)
    predicted = [s for s in scored if s.error is not None]
    lines += [
        "",
        f"- all predicted rows (none fitted on): {error_stats([s.error for s in predicted if s.error is not None])}",
        f"- pending (not predicted): {sum(1 for s in scored if s.pending)}",
        "- the compute efficiency at which each row's prediction would meet its measurement (a diagnostic, not used; "
        "none: even a perfect matmul efficiency predicts it slower): "
        + "; ".join(f"{s.run.label}: {_needed(s)}" for s in predicted),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write-docs", action="store_true", help="put the table into docs/planner.md")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    fitted = fit()
    text = markdown(evaluate(fitted=fitted), fitted)
    moe = moe_markdown(evaluate(published_moe_runs(), fitted))
    print(text)
    print("\nMixture-of-Experts runs:\n")
    print(moe)
    print(f"\n({time.perf_counter() - started:.0f} s)")
    if args.write_docs:
        write_docs(text)
        write_docs(moe, start=MOE_START, end=MOE_END)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
