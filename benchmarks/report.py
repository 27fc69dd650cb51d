"""The results as a rich table on the console and as markdown for BENCHMARKS.md (the same columns in both)."""

from __future__ import annotations

import os
import platform
import re
import resource
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

Row = dict[str, Any]


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:.3f} MB"


def _paired(row: Row) -> str:
    low, high = row["paired_overhead_pct_min"], row["paired_overhead_pct_max"]
    return f"{row['paired_overhead_pct']:+.1f}% ({low:+.1f}..{high:+.1f})"


def _state(row: Row) -> str:
    if row.get("model_state_mb") is None:
        return "-"
    ratio = row.get("model_state_vs_baseline")
    return f"{row['model_state_mb']:.2f}" + ("" if ratio is None else f" (x{ratio:.3f})")


def _loss(row: Row) -> str:
    mark = "ok" if row["same_loss"] else "DIFFERS"
    return f"{row['final_loss']:.6f} ({mark})"


COLUMNS: list[tuple[str, Callable[[Row], str]]] = [
    ("contender", lambda r: r["contender"]),
    ("tokens/s", lambda r: f"{r['tokens_per_s']:,.0f}"),
    ("p25-p75", lambda r: f"{r['tokens_per_s_p25']:,.0f}-{r['tokens_per_s_p75']:,.0f}"),
    ("step ms", lambda r: f"{r['step_ms']:.1f}"),
    ("x peer", lambda r: f"{r['speed_vs_baseline']:.3f}"),
    ("step vs peer, paired (min..max)", _paired),
    (
        "peak RSS MB (+growth)",
        lambda r: "shared" if r["peak_rss_mb"] is None else f"{r['peak_rss_mb']:.0f} (+{r['rss_growth_mb']:.0f})",
    ),
    ("model states MB (x peer)", _state),
    ("saved activations MB", lambda r: _num(r.get("saved_activation_mb"), ".2f")),
    ("grad buckets MB", lambda r: "+".join(f"{b / 1e6:.2f}" for b in r["info"].get("bucket_bytes", [])) or "-"),
    ("sent/step/rank", lambda r: _mb(r["wire_bytes_per_step"])),
    ("theory", lambda r: f"{_mb(r['theory_bytes_per_step'])}"),
    ("sent/theory", lambda r: _num(r["wire_vs_theory"], ".6f")),
    ("final loss", _loss),
    ("loss diff", lambda r: f"{r['loss_diff_vs_baseline']:.1e}"),
    ("max param diff", lambda r: _num(r["param_max_diff_vs_baseline"], ".1e")),
]


def machine() -> dict[str, Any]:
    """The facts that make numbers comparable: cores, CPU model, torch, Python, load average."""
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "plait": plait_revision(),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_1m": os.getloadavg()[0],
    }


def plait_revision() -> str:
    """The commit of the checkout that is measured, with ``+changes`` when plait/ has uncommitted edits."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", "plait")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{commit or 'unknown'}{' +changes' if dirty else ''}"


def busy_cpu_seconds() -> tuple[float, float]:
    """(CPU seconds every process on the machine has used since boot, CPU seconds this process and its reaped
    children have used): their difference over a run is the CPU the rest of the machine took meanwhile."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
        machine_s = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        machine_s = float("nan")
    own = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return machine_s, sum(u.ru_utime + u.ru_stime for u in own)


def conditions(info: dict[str, Any]) -> str:
    """The load before the run and the CPU other processes took during it, in words."""
    text = f"1-minute load {info['load_1m']:.2f} before the run"
    if "foreign_cpu_s" in info:
        text += (
            f"; other processes (and hypervisor steal) took {info['foreign_cpu_s']:.1f} CPU-s during its "
            f"{info['wall_s']:.0f} s "
            f"({100 * info['foreign_cpu_s'] / info['wall_s']:.0f}% of one core)"
        )
    return text


def table(title: str, rows: list[Row]) -> Table:
    """A rich table of one suite's rows."""
    out = Table(title=title, title_justify="left")
    for header, _ in COLUMNS:
        out.add_column(header, justify="left" if header == "contender" else "right")
    for row in rows:
        out.add_row(*(cell(row) for _, cell in COLUMNS))
    return out


def print_tables(console: Console, titles: dict[str, str], rows: list[Row], info: dict[str, Any]) -> None:
    """Print one table per suite, with the workload and the machine under it."""
    for suite, world in dict.fromkeys((r["suite"], r["world"]) for r in rows):
        mine = [r for r in rows if r["suite"] == suite and r["world"] == world]
        console.print(table(f"{titles.get(suite, suite)} ({world} rank{'s' if world > 1 else ''})", mine))
        console.print(
            f"  workload: {mine[0]['workload']}; world {mine[0]['world']}; {mine[0]['timed_steps']} timed "
            f"steps per contender in {mine[0]['rounds']} rounds ({mine[0]['interleave']} interleave)"
        )
    console.print(
        f"  plait {info['plait']}; machine: {info['nproc']} cores, {info['cpu']}, torch {info['torch']}; "
        f"{conditions(info)}"
    )


def markdown(suite: str, rows: list[Row], command: str, info: dict[str, Any]) -> str:
    """One suite's results as markdown: the command, then a table per world size, then the conditions."""
    lines = [f"`{command}`"]
    for world in dict.fromkeys(r["world"] for r in rows if r["suite"] == suite):
        mine = [r for r in rows if r["suite"] == suite and r["world"] == world]
        lines += ["", "| " + " | ".join(h for h, _ in COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
        lines += ["| " + " | ".join(cell(r) for _, cell in COLUMNS) + " |" for r in mine]
        first = mine[0]
        lines += [
            "",
            f"World size {world}: {first['workload']}; {first['timed_steps']} timed steps per contender in "
            f"{first['rounds']} rounds ({first['interleave']} interleave).",
        ]
    lines += [
        "",
        f"plait {info['plait']}. Machine: {info['nproc']} cores, {info['cpu']}, torch {info['torch']}; "
        f"{conditions(info)}.",
    ]
    return "\n".join(lines)


def replace_between(path: Path, start: str, end: str, body: str) -> None:
    """Replace what stands between the marker lines ``start`` and ``end`` in ``path`` with ``body`` (appending the
    marked block where the markers are missing), so the prose around a generated table stays as written."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{start}\n{body}\n{end}"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.DOTALL)
    text = pattern.sub(lambda _m: block, text) if pattern.search(text) else f"{text.rstrip()}\n\n{block}\n"
    path.write_text(text)


def replace_block(path: Path, name: str, body: str) -> None:
    """``replace_between`` the markers ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->`` of BENCHMARKS.md."""
    replace_between(path, f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->", body)


def write_markdown(path: Path, rows: list[Row], command: str, info: dict[str, Any]) -> None:
    """Write each suite's results into its block of ``path`` (``replace_block``)."""
    for suite in dict.fromkeys(r["suite"] for r in rows):
        replace_block(path, suite, markdown(suite, rows, command, info))
