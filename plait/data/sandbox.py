"""Jinja's immutable sandbox, metered: a chat template of an untrusted tokenizer folder renders under a time and a
size budget (``plait.data.budgets``).

Jinja's sandbox keeps a template from reaching Python, not from running long or filling memory: nested
``range(100000)`` loops ran past 60 s, and a string doubled in a loop reached ``MemoryError`` at 3.4 GB. Here a
``Meter`` follows each render, and ``MeteredEnvironment`` reports to it wherever a template can spend:

* **time**: every loop iteration (each ``{% for %}``'s iterable is wrapped when the template is compiled), every
  call (functions, methods, macros, filters), operator and output piece checks the deadline, so a template that
  loops without writing anything is stopped too;
* **size**: everything the template produces counts against the render's character budget: its output pieces
  (written or captured by ``{% set %}`` blocks and macros, through ``finalize``), and the strings, lists and numbers
  made by ``~``, slices, operators, calls and filters. Operations whose result can outgrow their inputs many times
  are checked *before* they run, from their arguments: ``*`` and ``**``, ``%`` and ``str.format`` widths and
  precisions, padding (``center``, ``ljust``, ``rjust``, ``zfill``, ``indent``), ``expandtabs``, ``replace``,
  ``join``, ``batch`` / ``slice`` with a fill, ``tojson`` with an indent and ``lipsum``; so one doubling never
  allocates more than the budget before the check.

No thread, no signal: the checks run in the rendering thread, in whatever process renders.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from jinja2 import nodes, pass_context
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter
from jinja2.utils import _PassArg
from jinja2.visitor import NodeTransformer
from markupsafe import Markup

from plait.data.budgets import RENDER_CHARACTERS, RENDER_SECONDS, Budget


class OverBudget(Exception):
    """A render went over ``budget`` (raised inside the template; ``ChatTemplate`` makes it a ``DataError``)."""

    def __init__(self, budget: Budget, limit: float, detail: str) -> None:
        super().__init__(f"{detail}: over {budget.describe(limit)}")
        self.budget, self.limit = budget, limit


class Meter:
    """The budget of one record's renders: a deadline over all of them, and ``characters`` per render (``start``
    resets the count)."""

    def __init__(self) -> None:
        self.seconds = RENDER_SECONDS.value()
        self.characters = int(RENDER_CHARACTERS.value())
        self.deadline = time.monotonic() + self.seconds
        self.used = 0
        self.renders = 0
        """How many renders the record took (``start`` counts them)."""

    def start(self) -> None:
        self.used = 0
        self.renders += 1

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise OverBudget(RENDER_SECONDS, self.seconds, "the template ran out of time")

    def need(self, size: int) -> None:
        """Refuse an operation that would make ``size`` more characters than the budget has left."""
        self.tick()
        if self.used + size > self.characters:
            made = f"{size:,} characters more" if size else f"{self.used:,} characters"
            raise OverBudget(RENDER_CHARACTERS, self.characters, f"the template made {made}")

    def charge(self, size: int) -> None:
        self.need(size)
        self.used += size

    def collect(self, pieces: Iterator[str]) -> str:
        """The pieces a render yields, joined: counted 1,024 at a time (references until joined, so nothing is
        allocated before the count), the clock read as often (a piece that takes long to make is stopped by the
        checks inside the template)."""
        kept: list[str] = []
        while batch := list(itertools.islice(pieces, 1024)):
            self.charge(sum(map(len, batch)))
            kept += batch
        return "".join(kept)


def size_of(value: Any) -> int:
    """What ``value`` costs the size budget: the length of a string or container, the bits of an integer (a
    chat template has no use for large numbers, and arithmetic on them costs more than their size)."""
    if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)):
        return len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value.bit_length()
    return 0


def text_size(value: Any, cap: int) -> int:
    """About how many characters ``str(value)`` has (stopping once past ``cap``): the output of ``{{ value }}``."""
    total, stack = 0, [value]
    while stack and total <= cap:
        item = stack.pop()
        if isinstance(item, (str, bytes)):
            total += len(item) + 4
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
            total += 2 + 2 * len(item)
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
            total += 2 + 2 * len(item)
        elif isinstance(item, int) and not isinstance(item, bool):
            total += item.bit_length() // 3 + 1
        else:
            total += 32
    return total


_PERCENT = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")
_DIGITS = re.compile(r"\d+")


def _ints(values: Iterable[Any]) -> int:
    return sum(abs(v) for v in values if isinstance(v, int) and not isinstance(v, bool))


def percent_size(template: Any, values: Any) -> int:
    """The widths and precisions a ``%`` format asks for (``"%100000000s"``, ``"%.9999999f"``, ``"%*d"``)."""
    if not isinstance(template, str):
        return 0
    size = 0
    for width, precision in _PERCENT.findall(template):
        for field in (width, precision):
            size += int(field) if field.isdigit() else 0
        if "*" in (width, precision):
            size += _ints(values if isinstance(values, tuple) else (values,))
    return size


def _int_arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, default: int = 0) -> int:
    value = args[index] if len(args) > index else kwargs.get(name, default)
    return abs(value) if isinstance(value, int) and not isinstance(value, bool) else 0


def _join_size(separator: Any, items: Any) -> int:
    if not isinstance(items, (list, tuple, str, dict)):
        return 0  # an iterator: its items are counted as they are made
    return len(str(separator)) * len(items) + sum(len(item) if isinstance(item, str) else 32 for item in items)


def _replace_size(text: Any, new: Any, count: Any) -> int:
    times = count if isinstance(count, int) and count >= 0 else len(str(text)) + 1
    return len(str(text)) + times * len(str(new))


def _indent_size(text: Any, width: Any) -> int:
    prefix = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    return len(str(text)) + (str(text).count("\n") + 1) * abs(prefix)


def method_size(method: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """What a call of a ``str`` method that can outgrow its inputs will make, known before it runs (else 0)."""
    owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    if not isinstance(owner, (str, bytes)):
        return 0
    if name in ("center", "ljust", "rjust", "zfill"):
        return _int_arg(args, kwargs, 0, "width")
    if name == "expandtabs":
        return len(owner) * _int_arg(args, kwargs, 0, "tabsize", 8)
    if name == "replace":
        count = args[2] if len(args) > 2 else kwargs.get("count", -1)
        return _replace_size(owner, args[1] if len(args) > 1 else "", count)
    if name == "join" and args:
        return _join_size(owner, args[0])
    return 0


FILTER_SIZES: dict[str, Callable[..., int]] = {
    "center": lambda value, width=80, *_: abs(width) if isinstance(width, int) else 0,
    "indent": lambda value, width=4, *_, **__: _indent_size(value, width),
    "replace": lambda value, old="", new="", count=None, *_: _replace_size(value, new, count),
    "join": lambda value, d="", *_, **__: _join_size(d, value),
    "batch": lambda value, linecount=0, fill_with=None, *_: 0 if fill_with is None else _ints([linecount]),
    "slice": lambda value, slices=0, fill_with=None, *_: _ints([slices]),
    "format": lambda value, *args, **kwargs: percent_size(value, args or tuple(kwargs.values())),
    "lipsum": lambda n=5, html=True, low=20, high=100, **named: _ints([n]) * (_ints([named.get("max", high)]) + 1) * 12,
    "tojson": lambda value, indent=None, *_: _ints([indent]) * text_size(value, 1 << 62) if indent else 0,
}
"""For the filters (and ``lipsum``) whose result can outgrow their inputs: its size from the arguments, before
they run."""


def _tojson(value: Any, indent: int | None = None) -> str:
    """transformers' ``tojson``: JSON without escaping non-ASCII."""
    return json.dumps(value, ensure_ascii=False, indent=indent)


class _Guards(NodeTransformer):
    """Rewrites a parsed template so that loops, ``~``, slices and literal text report to the meter: each goes
    through one of ``MeteredEnvironment``'s guard filters (``GUARDS``), whose names no template can write."""

    def __init__(self, environment: MeteredEnvironment) -> None:
        self.environment = environment
        self.capturing = 0

    def _guard(self, name: str, node: nodes.Node) -> nodes.Expr:
        assert isinstance(node, nodes.Expr)
        guarded = nodes.Filter(node, GUARDS[name], [], [], None, None)
        guarded.set_lineno(node.lineno or 1)
        guarded.set_environment(self.environment)
        return guarded

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = self._guard("iterate", node.iter)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return self._guard("concat", nodes.Tuple(list(node.nodes), "load", lineno=node.lineno))

    def visit_Getitem(self, node: nodes.Getitem) -> nodes.Node:
        self.generic_visit(node)
        return self._guard("value", node) if isinstance(node.arg, nodes.Slice) else node

    def _captured(self, node: nodes.Node) -> nodes.Node:
        self.capturing += 1
        try:
            return self.generic_visit(node)
        finally:
            self.capturing -= 1

    visit_Macro = visit_CallBlock = visit_AssignBlock = visit_FilterBlock = _captured

    def visit_Output(self, node: nodes.Output) -> nodes.Node:
        """Output written where the render yields it is counted as it comes (``ChatTemplate.render``); output
        captured into a variable (macros, ``{% set %}`` and filter blocks, ``caller``) is counted piece by piece,
        literal text included, before Jinja joins it."""
        self.generic_visit(node)
        if self.capturing:
            node.nodes = [
                self._guard("value", nodes.Const(child.data, lineno=child.lineno))
                if isinstance(child, nodes.TemplateData)
                else self._guard("value", child)
                for child in node.nodes
            ]
        return node


GUARDS = {name: f"plait:{name}" for name in ("iterate", "concat", "value")}
"""The guard filters' names: not identifiers, so a template cannot name them (Jinja folds no filter that takes the
context, so they run at render time)."""


class _MeteredFormatter(SandboxedFormatter):
    """``str.format`` in the sandbox, each field's width and precision checked before it is formatted."""

    def __init__(self, environment: MeteredEnvironment) -> None:
        super().__init__(environment)
        self.meter = environment.meter

    def format_field(self, value: Any, format_spec: str) -> Any:
        if self.meter is not None:
            self.meter.need(sum(int(digits) for digits in _DIGITS.findall(format_spec)))
        return super().format_field(value, format_spec)


class MeteredEnvironment(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox reporting to ``meter`` (module docstring); with no meter, it is Jinja's own."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self, **options: Any) -> None:
        super().__init__(finalize=self._finalize, **options)
        self.meter: Meter | None = None
        self.filters["tojson"] = _tojson
        self.filters = {name: self._metered_filter(name, f) for name, f in self.filters.items()}
        lipsum = self.globals["lipsum"]
        assert callable(lipsum)
        self.globals["lipsum"] = self._metered_filter("lipsum", lipsum)
        guards = {"iterate": self._iterate, "concat": self._concat, "value": self._value}
        self.filters.update({GUARDS[name]: guard for name, guard in guards.items()})

    # ------------------------------------------------------------------ what the compiled template calls
    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        guarded = _Guards(self).visit(tree)
        assert isinstance(guarded, nodes.Template)
        return guarded

    @pass_context
    def _iterate(self, context: Any, iterable: Any) -> Iterator[Any]:
        meter = self.meter
        for count, item in enumerate(iterable):
            if meter is not None and not count & 63:  # the clock every 64 items: the body checks its own work
                meter.tick()
            yield item

    @pass_context
    def _concat(self, context: Any, parts: tuple[Any, ...]) -> str:
        """``a ~ b ~ ...`` (Jinja's ``str_join``), its size checked before the join."""
        if self.meter is not None:
            self.meter.charge(sum(len(p) if isinstance(p, str) else text_size(p, self.meter.characters) for p in parts))
        return "".join(map(str, parts))

    @pass_context
    def _value(self, context: Any, value: Any) -> Any:
        return self.metered_value(value)

    def metered_value(self, value: Any) -> Any:
        if self.meter is not None:
            self.meter.charge(size_of(value))
        return value

    def _finalize(self, value: Any) -> Any:
        """Every ``{{ value }}`` before Jinja makes it text: a container or number is sized first."""
        if self.meter is not None and not isinstance(value, str) and value is not None:
            self.meter.need(text_size(value, self.meter.characters))
        return value

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if self.meter is not None:
            self.meter.need(_binop_size(operator, left, right))
        return self.metered_value(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - Jinja's names
        meter = __self.meter
        if meter is None:
            return super().call(__context, __obj, *args, **kwargs)
        meter.need(method_size(__obj, args, kwargs))
        return __self.metered_value(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is None or self.meter is None or isinstance(value.__self__, Markup):
            return wrapped
        text, is_map, formatter = value.__self__, value.__name__ == "format_map", _MeteredFormatter(self)

        def metered_format(*args: Any, **kwargs: Any) -> str:
            if is_map:  # as Jinja's own wrapper
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument and no keyword arguments")
                kwargs, args = args[0], ()
            return type(text)(formatter.vformat(text, args, kwargs))

        return functools.update_wrapper(metered_format, value)

    def _metered_filter(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        """``original`` (a filter, or ``lipsum``) checked before it runs (``FILTER_SIZES``) and its result counted.
        It takes the context, so that Jinja never runs it while compiling (when no meter is there) to fold a
        constant: ``'x'|center(10**9)`` would otherwise be made then."""
        predict = FILTER_SIZES.get(name)
        passes = _PassArg.from_obj(original)

        def first(context: Any) -> tuple[Any, ...]:
            if passes is _PassArg.context:
                return (context,)
            if passes is _PassArg.eval_context:
                return (context.eval_ctx,)
            return (context.environment,) if passes is _PassArg.environment else ()

        @pass_context
        def metered(context: Any, *args: Any, **kwargs: Any) -> Any:
            meter = self.meter
            if meter is not None and predict is not None:
                meter.need(predict(*args, **kwargs))
            return self.metered_value(original(*first(context), *args, **kwargs))

        functools.update_wrapper(metered, original, updated=())
        return metered


def _binop_size(operator: str, left: Any, right: Any) -> int:
    """What ``left operator right`` will make, known before it runs (``*``, ``**``, ``%``; ``+`` is additive)."""
    if operator == "*":
        if isinstance(right, int) and not isinstance(right, bool) and not isinstance(left, (int, float)):
            return size_of(left) * max(right, 0)
        if isinstance(left, int) and not isinstance(left, bool) and not isinstance(right, (int, float)):
            return size_of(right) * max(left, 0)
        return size_of(left) + size_of(right)
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        return max(left.bit_length(), 1) * right
    if operator == "%":
        return percent_size(left, right)
    return size_of(left) + size_of(right)


__all__ = ["FILTER_SIZES", "Meter", "MeteredEnvironment", "OverBudget", "size_of", "text_size"]
