"""How well the cost model predicts published training runs: fitted per GPU generation on some tables, reported on
others (``published.py``), in-sample, leave-one-out and out-of-table errors side by side.

The one fitted number per GPU generation is its compute efficiency (achieved / peak FLOP/s of a step's matmuls,
``Hardware.compute_efficiency``). For a fitting row i, ``row_efficiency`` finds e_i, the efficiency at which the
prediction equals the measurement (bisection: predicted throughput rises with the efficiency). The generation's
value is the median of its fitting rows' e_i, which is the value at which the median of measured / predicted is 1.
Then:

- in-sample error of a fitting row: predicted with the fitted value (the row helped choose it);
- leave-one-out error of a fitting row: predicted with the median of the *other* fitting rows' e_j;
- out-of-sample error of a test row (another paper, or another table of a fitting paper): predicted with the fitted
  value of its generation, which never saw it.

An efficiency belongs to the implementation it was fitted on, on that generation (``hardware.EFFICIENCY_FITTED_ON``:
Megatron-LM on A100s, Composer's FSDP on H100s). A row of another implementation has no efficiency of its own
published: it borrows its generation's, and ``Scored.borrowed`` names whose (the table shows it beside the
efficiency), so that its error is read as the cost model's and the borrowing's together.

Errors are on throughput: predicted / measured - 1 for TFLOP/s and MFU, measured / predicted time - 1 for step times
(a positive error: the model is optimistic). ``python -m benchmarks.planner_published`` prints the table
(``--write-docs`` puts it into docs/planner.md).
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from plait.planner.costs import IMPLEMENTATIONS
from plait.planner.hardware import EFFICIENCY_FITTED_ON, GENERATION_EFFICIENCY, Hardware, get_hardware
from plait.planner.predict import Prediction, predict
from plait.planner.published import SOURCES, PublishedRun, published_runs


def predict_run(run: PublishedRun, efficiency: float) -> Prediction:
    """``run`` predicted on its hardware at compute ``efficiency``."""
    hw: Hardware = dataclasses.replace(get_hardware(run.gpu), compute_efficiency=efficiency)
    return predict(run.spec, run.layout, hw, run.global_batch, implementation=run.implementation)


def predicted_value(run: PublishedRun, prediction: Prediction) -> float:
    """The prediction in the unit the row was published in."""
    if run.metric == "hardware_tflops":
        return prediction.tflops_per_device
    if run.metric == "mfu":
        return prediction.mfu
    if run.metric == "step_time":
        return prediction.step_time
    if run.metric == "tokens_per_gpu":
        return prediction.tokens_per_s / prediction.world_size
    raise ValueError(f"unknown metric {run.metric!r}")


def throughput_error(run: PublishedRun, predicted: float) -> float:
    """predicted / measured throughput - 1 (see the module docstring)."""
    if run.metric == "step_time":
        return run.value / predicted - 1
    return predicted / run.value - 1


def row_efficiency(run: PublishedRun, low: float = 0.05, high: float = 1.0, tolerance: float = 1e-4) -> float:
    """The compute efficiency at which ``run``'s prediction equals its measurement (``high`` if even that is too
    slow): the root of the throughput error, by the secant method (a step's time is close to a / e + b, so it
    converges in a few predictions), kept inside the bracket [low, high] and falling back to bisection."""

    def error(e: float) -> float:
        return throughput_error(run, predicted_value(run, predict_run(run, e)))

    f_high = error(high)
    if f_high <= 0:
        return high
    f_low = error(low)
    a, b = low, high  # the bracket: too slow at a, too fast at b
    x0, f0, x1, f1 = low, f_low, high, f_high
    for _ in range(40):
        x = x1 - f1 * (x1 - x0) / (f1 - f0) if f1 != f0 else (a + b) / 2
        if not a < x < b:
            x = (a + b) / 2
        fx = error(x)
        if fx < 0:
            a = x
        else:
            b = x
        x0, f0, x1, f1 = x1, f1, x, fx
        if abs(fx) < tolerance or b - a < tolerance:
            return x
    return (a + b) / 2


def fit(runs: list[PublishedRun] | None = None) -> dict[str, tuple[float, dict[str, float]]]:
    """Per generation with fitting rows: (fitted efficiency, {row label: its own efficiency e_i})."""
    runs = published_runs() if runs is None else runs
    out: dict[str, tuple[float, dict[str, float]]] = {}
    for generation in sorted({r.generation for r in runs if r.role == "fit"}):
        own = {r.label: row_efficiency(r) for r in runs if r.role == "fit" and r.generation == generation}
        out[generation] = (statistics.median(own.values()), own)
    return out


@dataclass
class Scored:
    """One published row, predicted. ``loo`` (fitting rows only) is the prediction with its own row left out of the
    fit; ``pending`` says why a row could not be predicted."""

    run: PublishedRun
    predicted: float | None = None
    loo: float | None = None
    fits: bool = True
    memory_gib: float = 0.0
    limit_gib: float = 0.0
    efficiency: float = 0.0
    pending: str = ""
    borrowed: str = ""
    """The implementation family whose efficiency the row was predicted with, when not its own (module docstring)."""

    @property
    def error(self) -> float | None:
        return None if self.predicted is None else throughput_error(self.run, self.predicted)

    @property
    def loo_error(self) -> float | None:
        return None if self.loo is None else throughput_error(self.run, self.loo)


def evaluate(
    runs: list[PublishedRun] | None = None, fitted: dict[str, tuple[float, dict[str, float]]] | None = None
) -> list[Scored]:
    """Every row predicted with its generation's fitted efficiency, and the fitting rows also leave-one-out."""
    runs = published_runs() if runs is None else runs
    fitted = fit(runs) if fitted is None else fitted
    scored = []
    for run in runs:
        if run.pending:
            scored.append(Scored(run, pending=run.pending))
            continue
        efficiency = fitted[run.generation][0] if run.generation in fitted else GENERATION_EFFICIENCY[run.generation]
        prediction = predict_run(run, efficiency)
        owner = EFFICIENCY_FITTED_ON.get(run.generation, "")
        row = Scored(
            run,
            predicted_value(run, prediction),
            fits=prediction.fits,
            memory_gib=prediction.memory.device / 2**30,
            limit_gib=prediction.memory_limit / 2**30,
            efficiency=efficiency,
            borrowed="" if IMPLEMENTATIONS[run.implementation].family == owner else owner,
        )
        if run.role == "fit":
            others = [e for label, e in fitted[run.generation][1].items() if label != run.label]
            row.loo = predicted_value(run, predict_run(run, statistics.median(others)))
        scored.append(row)
    return scored


@lru_cache(maxsize=1)
def default_evaluation() -> tuple[dict[str, tuple[float, dict[str, float]]], list[Scored]]:
    """(``fit()``, ``evaluate()``) of every published row, computed once per process."""
    fitted = fit()
    return fitted, evaluate(fitted=fitted)


def error_stats(errors: list[float]) -> str:
    if not errors:
        return "-"
    absolute = [abs(e) for e in errors]
    return f"median {statistics.median(absolute):.1%}, max {max(absolute):.1%} ({len(errors)} rows)"


def summary(scored: list[Scored]) -> dict[str, Any]:
    """Error statistics by kind: in-sample and leave-one-out (fitting rows), out-of-sample (other papers) and
    out-of-table (other tables of a fitting paper), and the papers the out-of-sample rows come from."""
    fit_papers = {SOURCES[s.run.source].paper for s in scored if s.run.role == "fit"}
    fitting = [s for s in scored if s.run.role == "fit" and s.error is not None]
    tests = [s for s in scored if s.run.role == "test" and s.error is not None]
    out_of_sample = [s for s in tests if SOURCES[s.run.source].paper not in fit_papers]
    out_of_table = [s for s in tests if SOURCES[s.run.source].paper in fit_papers]
    return {
        "in_sample": [s.error for s in fitting],
        "leave_one_out": [s.loo_error for s in fitting],
        "out_of_sample": [s.error for s in out_of_sample],
        "out_of_table": [s.error for s in out_of_table],
        "out_of_sample_papers": sorted({SOURCES[s.run.source].paper for s in out_of_sample}),
        "not_fitting": [s for s in scored if s.predicted is not None and not s.fits],
        "pending": [s for s in scored if s.pending],
        "borrowed": [s.error for s in tests if s.borrowed],
        "own": [s.error for s in tests if not s.borrowed],
    }


def table(scored: list[Scored]) -> list[str]:
    """The rows of the docs table: measured, predicted, error (and leave-one-out), the efficiency used (and whose,
    when borrowed), memory."""
    units = {"hardware_tflops": "TFLOP/s", "mfu": "MFU", "step_time": "s/iter", "tokens_per_gpu": "tokens/s/GPU"}
    lines = [
        "| source | row | measured | predicted | error | leave-one-out | efficiency | memory (GiB) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in scored:
        run = s.run
        role = "fit" if run.role == "fit" else "test"
        value = f"{run.value:.3g} {units[run.metric]}"
        if s.pending:
            lines.append(f"| {run.source} ({role}) | {run.label} | {value} | pending: {s.pending} | | | | |")
            continue
        loo_text = "" if s.loo_error is None else f"{s.loo_error:+.1%}"
        memory = f"{s.memory_gib:.0f} / {s.limit_gib:.0f}" + ("" if s.fits else " **does not fit**")
        efficiency = f"{s.efficiency:.3f}" + (f" ({s.borrowed}'s)" if s.borrowed else "")
        lines.append(
            f"| {run.source} ({role}) | {run.label} | {value} | {s.predicted:.3g} | {s.error:+.1%} | {loo_text} | "
            f"{efficiency} | {memory} |"
        )
    return lines


def markdown(scored: list[Scored], fitted: dict[str, tuple[float, dict[str, float]]]) -> str:
    """The docs table (``table``); then the statistics."""
    lines = table(scored)
    stats = summary(scored)
    lines += [
        "",
        "Fitted compute efficiency per generation, of the implementation it was fitted on: "
        + ", ".join(
            f"{g} {value:.3f} ({EFFICIENCY_FITTED_ON[g]}, from {len(own)} rows)" for g, (value, own) in fitted.items()
        )
        + ".",
        "",
        f"- in-sample (fitting rows): {error_stats(stats['in_sample'])}",
        f"- leave-one-out (fitting rows, each predicted by a fit without it): {error_stats(stats['leave_one_out'])}",
        f"- out-of-sample ({', '.join(stats['out_of_sample_papers'])}: papers not used for fitting): "
        f"{error_stats(stats['out_of_sample'])}",
        f"- out-of-table (other tables of a fitting source): {error_stats(stats['out_of_table'])}",
        f"- test rows of the implementation each efficiency was fitted on: {error_stats(stats['own'])}; of other "
        f"implementations, borrowing it: {error_stats(stats['borrowed'])}",
        f"- published layouts predicted not to fit their GPUs: {len(stats['not_fitting'])}"
        + "".join(f"; {s.run.label}: {s.memory_gib:.1f} of {s.limit_gib:.1f} GiB" for s in stats["not_fitting"]),
        f"- pending (not predicted): {len(stats['pending'])}",
        "",
        "By source:",
        "",
    ]
    for source in dict.fromkeys(s.run.source for s in scored):
        rows = [s for s in scored if s.run.source == source and s.error is not None]
        loo = [s.loo_error for s in rows if s.loo_error is not None]
        role = SOURCES[source].role
        text = f"- {source} ({role}): {error_stats([s.error for s in rows if s.error is not None])}"
        lines.append(text + (f"; leave-one-out {error_stats(loo)}" if loo else ""))
    return "\n".join(lines)


__all__ = [
    "Scored",
    "default_evaluation",
    "error_stats",
    "evaluate",
    "fit",
    "markdown",
    "predict_run",
    "predicted_value",
    "row_efficiency",
    "summary",
    "table",
    "throughput_error",
]
