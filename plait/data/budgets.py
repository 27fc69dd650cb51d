"""The budgets under which ``plait data prepare`` reads untrusted records and renders untrusted chat templates.

Inputs and tokenizer folders come from third parties (docs/security.md): a record or a template may be crafted to
take unbounded time or memory (a 50 MB message, 3,000 exchanges in one conversation, nested loops, a string
doubled until memory runs out). Each budget below bounds one such cost; going over it is a one-line ``DataError``
naming the record, the budget and the environment variable that raises it (for trusted data that legitimately
needs more). The defaults are far above real data: chats of tens of turns, messages up to about 1 MB.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from plait.errors import DataError


@dataclass(frozen=True)
class Budget:
    """A named limit with a default, overridable by the environment variable ``env``."""

    what: str
    """What it bounds, for messages: "record size", "turns", ..."""
    env: str
    default: float
    unit: str

    def value(self) -> float:
        """The limit in force: ``env`` when set (a positive number), else the default."""
        text = os.environ.get(self.env, "").strip()
        if not text:
            return self.default
        try:
            value = float(text.replace("_", ""))
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise DataError(
                f"{self.env}={text!r} must be a positive number of {self.unit}. Fix: e.g. {self.env}={self.default:g}."
            )
        return value

    def describe(self, value: float | None = None) -> str:
        """``the render-time budget (30 seconds, PLAIT_MAX_RENDER_SECONDS)``."""
        shown = self.value() if value is None else value
        number = f"{shown:,.0f}" if shown == int(shown) else f"{shown:g}"
        return f"the {self.what} budget ({number} {self.unit}, {self.env})"

    def fix(self, value: float | None = None) -> str:
        """The end of a refusal: how to raise the budget for data that is trusted and needs more."""
        shown = self.value() if value is None else value
        number = f"{shown:.0f}" if shown == int(shown) else f"{shown:g}"
        return f"raise {self.env} (now {number}) only if the data and the tokenizer folder are trusted"


RECORD_BYTES = Budget("record size", "PLAIT_MAX_RECORD_BYTES", 8 << 20, "bytes")
"""The longest JSON Lines record (one line, newline excluded): 8 MiB. Checked as the line is read, so a longer one
never reaches memory whole, nor the Rust tokenizer (which takes about 200 bytes per character of one document: a
5 MB document peaks near 1 GB, and a 50 MB message aborted the process)."""

TURNS = Budget("turns", "PLAIT_MAX_TURNS", 1024, "messages")
"""The most messages in one chat conversation: 1,024. Finding the turns renders one prefix of the conversation per
assistant turn (``plait.data.instruct``), so the work grows with the square of the turns; this bounds it."""

RENDER_SECONDS = Budget("render time", "PLAIT_MAX_RENDER_SECONDS", 30, "seconds")
"""The longest a chat template may take over one record, all its renders together: 30 s. Checked as the template
loops, calls and writes (``plait.data.sandbox``), so a template that loops without writing is stopped too."""

RENDER_CHARACTERS = Budget("render size", "PLAIT_MAX_RENDER_CHARACTERS", 128 << 20, "characters")
"""What one render of a chat template may produce: 128 Mi characters, counting its output and every string, list
and number it builds on the way (``plait.data.sandbox``): 16 times the largest record, and at most a few hundred MB
of memory."""

ALL = (RECORD_BYTES, TURNS, RENDER_SECONDS, RENDER_CHARACTERS)

__all__ = ["ALL", "RECORD_BYTES", "RENDER_CHARACTERS", "RENDER_SECONDS", "TURNS", "Budget"]
