"""The live view of a parameter-server job: per server its version, updates/s, staleness and live workers.

In a terminal it is a rich table redrawn in place (``rich.live.Live``); elsewhere (CI, a log file) one log line per
``log_every_s`` with the same figures, so a job's progress is visible either way. It reads the servers' reports
(``ShardServer.report``), so it shows what the servers know, not what the workers believe.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from plait.logging import get_logger

log = get_logger(__name__)


def summary_line(report: dict[str, Any]) -> str:
    """One server's figures as text: version, updates/s, staleness mean/max, live workers, duplicates ignored."""
    staleness = report["staleness"]
    resumed = "" if report.get("resumed_from") is None else f", resumed at {report['resumed_from']}"
    return (
        f"server {report['index']}: version {report['version']}, {report['updates_per_s']:.1f} updates/s, "
        f"staleness mean {staleness['mean']:.2f} max {staleness['max']}, {report['live_workers']} live workers, "
        f"{report['duplicates']} duplicates ignored{resumed}"
    )


def _table(reports: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for column in (
        "server",
        "version",
        "updates/s",
        "staleness mean",
        "staleness max",
        "live workers",
        "pushes applied",
        "duplicates",
    ):
        table.add_column(column, justify="right")
    for report in reports:
        staleness = report["staleness"]
        table.add_row(
            str(report["index"]),
            str(report["version"]),
            f"{report['updates_per_s']:.1f}",
            f"{staleness['mean']:.2f}",
            str(staleness["max"]),
            str(report["live_workers"]),
            str(report["pushes_applied"]),
            str(report["duplicates"]),
        )
    return table


class ProgressView:
    """Show the servers' reports as they come; `close` leaves the last table on screen."""

    def __init__(self, title: str, console: Console | None = None, log_every_s: float = 1.0) -> None:
        self.title, self.log_every_s = title, log_every_s
        self.console = console or Console(stderr=True)
        self.live = Live(console=self.console, auto_refresh=False) if self.console.is_terminal else None
        self._last_log = float("-inf")
        if self.live is not None:
            self.live.start()

    def update(self, reports: list[dict[str, Any]]) -> None:
        if self.live is not None:
            self.live.update(_table(reports, self.title), refresh=True)
        elif time.monotonic() - self._last_log >= self.log_every_s:
            self._last_log = time.monotonic()
            for report in reports:
                log.info("%s", summary_line(report))

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()


__all__ = ["ProgressView", "summary_line"]
