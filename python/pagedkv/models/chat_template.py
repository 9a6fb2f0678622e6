"""Rendering a model's chat template (Jinja2, from the GGUF file) with bounded time and memory.

A chat template is code from the model file. It runs in Jinja2's ``ImmutableSandboxedEnvironment``
(no attribute access to internals, no mutation of the caller's objects), as Hugging Face renders
it, plus the bounds the sandbox lacks. Every way a template can do unbounded work passes a check:

- **Loops**: the template's syntax tree is rewritten before compilation so that every ``for``
  iterates through a guard that counts iterations against ``max_loop_iterations`` (over the whole
  render) and checks the deadline on each one. ``range`` is the sandbox's (at most 100 000
  elements). A pure-CPU loop with no output (``{% for i in range(100000) %}{% for j in
  range(100000) %}{% endfor %}{% endfor %}``) therefore stops after 10**6 iterations.
- **Calls, filters, operators**: every call (macros, methods, ``loop()``) and every filter checks
  the deadline; an integer argument larger than the output budget is refused (``center(10**9)``,
  ``"x".ljust(10**9)``); the sizes that multiply (``*``, ``+``, ``**`` of integers, ``%`` and
  ``str.format`` widths, ``replace``, ``join``, ``indent``, ``expandtabs``) are computed and
  refused *before* the operation allocates; every string or collection a call, filter, operator
  or ``~`` concatenation produces is checked against ``max_output_chars``.
- **Output**: the template is rendered chunk by chunk (``generate``), checking the running size
  and the deadline per chunk; captured blocks (``{% set x %}``, macro bodies) are joined through a
  checked ``concat``.
- **Errors**: ``TemplateSyntaxError``, ``UndefinedError``, ``SecurityError``, a template's own
  ``raise_exception(message)`` (defined, as Hugging Face does), ``RecursionError`` from runaway
  macros and any other failure inside the template become ``ChatTemplateError``.
  ``KeyboardInterrupt``/``SystemExit`` propagate.
"""

from __future__ import annotations

import contextvars
import functools
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pagedkv.errors import ChatTemplateError

__all__ = [
    "MAX_COLLECTION_ITEMS",
    "MAX_LOOP_ITERATIONS",
    "MAX_OUTPUT_CHARS",
    "MAX_RENDER_SECONDS",
    "compile_chat_template",
    "render_chat_template",
]

MAX_RENDER_SECONDS = 1.0  # real templates render in about a millisecond
MAX_OUTPUT_CHARS = 1 << 22  # 4 Mi characters: any string or collection a template builds, and the output
MAX_COLLECTION_ITEMS = 1 << 17  # any list, tuple or dict a template builds (``sort`` runs Python per item)
MAX_LOOP_ITERATIONS = 1_000_000  # over all loops of one render
_MAX_INT_BITS = 1 << 16  # integers a template computes (``9**9**9`` would take minutes)
_RESERVED = "__pagedkv_"  # names of the guards the rewritten template calls
_FORMAT_NUMBER = re.compile(r"\d+")


@dataclass
class _Budget:
    deadline: float
    max_chars: int
    max_items: int
    iterations_left: int

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateError("the chat template ran past its time budget")

    def size(self, n: int, what: str, *, items: bool = False) -> None:
        limit = self.max_items if items else self.max_chars
        if n > limit:
            unit = "items" if items else "characters"
            raise ChatTemplateError(f"the chat template built {what} of {n} {unit} (limit {limit})")


_CURRENT: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("pagedkv_chat_budget", default=None)


def _budget() -> _Budget:
    budget = _CURRENT.get()
    if budget is None:  # a compiled template used outside render_chat_template
        raise ChatTemplateError("chat templates render only through render_chat_template")
    return budget


def _check_value(budget: _Budget, value: Any, what: str) -> Any:
    if isinstance(value, (str, bytes)):
        budget.size(len(value), what)
    elif isinstance(value, (list, tuple, dict, set, frozenset)):
        budget.size(len(value), what, items=True)
    elif type(value) is int and value.bit_length() > _MAX_INT_BITS:
        raise ChatTemplateError(f"the chat template computed an integer of {value.bit_length()} bits")
    return value


def _check_int_args(budget: _Budget, args: Iterable[Any]) -> None:
    for arg in args:
        if type(arg) is int and abs(arg) > budget.max_chars:
            raise ChatTemplateError(f"the chat template passed {arg} to a call (limit {budget.max_chars})")


def _check_format(budget: _Budget, fmt: str) -> None:
    """A width or precision in a format string is an allocation size."""
    for number in _FORMAT_NUMBER.findall(fmt):
        if len(number) > 9 or int(number) > budget.max_chars:
            raise ChatTemplateError(
                f"the chat template formats with width {number} (limit {budget.max_chars})"
            )


def _length(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple)) else 0


def _estimate_call(name: str, target: Any, args: tuple[Any, ...]) -> int:
    """Upper bound of the result's size for the calls whose output can be a product of inputs."""
    if name == "replace" and isinstance(target, str) and len(args) >= 2:
        old, new = str(args[0]), str(args[1])
        return len(target) + (len(target) + 1) * len(new) // max(len(old), 1)
    if name == "join" and isinstance(target, str) and args:
        items = args[0]
        if isinstance(items, str):
            return len(items) * (len(target) + 1)
        count = len(items) if isinstance(items, (list, tuple, dict)) else 0
        return count * len(target) + sum(_length(i) for i in items) if count else 0
    if name == "expandtabs" and isinstance(target, str):
        width = args[0] if args and type(args[0]) is int else 8
        return len(target) + target.count("\t") * max(width, 0)
    if name == "indent" and isinstance(target, str):
        indent: Any = args[0] if args else 4  # a width or the string to indent with
        width = len(indent) if isinstance(indent, str) else indent if type(indent) is int else 0
        return len(target) + (target.count("\n") + 1) * max(width, 0)
    return 0


def _guarded_iter(iterable: Any) -> Iterator[Any]:
    budget = _budget()
    for item in iterable:
        budget.iterations_left -= 1
        if budget.iterations_left < 0:
            raise ChatTemplateError("the chat template ran past its loop-iteration budget")
        budget.tick()
        yield item


def _guarded_concat(*parts: Any) -> str:
    budget = _budget()
    strings = [str(p) for p in parts]
    budget.size(sum(len(s) for s in strings), "a string")
    return "".join(strings)


def _raise_exception(message: Any = "") -> None:
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


def _strftime_now(fmt: str) -> str:
    _check_format(_budget(), str(fmt))
    return datetime.now().strftime(str(fmt))


def _guard_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)  # keeps jinja_pass_arg: the compiler reads it to pass the context
    def guarded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.tick()
        _check_int_args(budget, (*args, *kwargs.values()))
        values = [a for a in args if not _is_jinja_state(a)]
        if name == "format" and values and isinstance(values[0], str):
            _check_format(budget, values[0])
        target, rest = (values[0], tuple(values[1:])) if values else (None, ())
        budget.size(_estimate_call(name, target, rest), f"the result of the {name!r} filter")
        if name == "join" and values:  # join(value, d=""): the separator comes second
            items = list(values[0]) if not isinstance(values[0], str) else values[0]
            sep = values[1] if len(values) > 1 else kwargs.get("d", "")
            budget.size(_estimate_call("join", str(sep), (items,)), "the result of the 'join' filter")
            args = tuple(items if a is values[0] else a for a in args)
        return _check_value(budget, func(*args, **kwargs), f"the result of the {name!r} filter")

    return guarded


def _is_jinja_state(value: Any) -> bool:
    from jinja2.environment import Environment
    from jinja2.nodes import EvalContext
    from jinja2.runtime import Context

    return isinstance(value, (Context, EvalContext, Environment))


@functools.lru_cache(maxsize=1)
def _environment_class() -> type[Any]:
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%", "+"})

        def __init__(self) -> None:
            super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            self.filters = {name: _guard_filter(name, f) for name, f in self.filters.items()}
            self.globals.update(
                {
                    "raise_exception": _raise_exception,
                    "strftime_now": _strftime_now,
                    f"{_RESERVED}iter": _guarded_iter,
                    f"{_RESERVED}concat": _guarded_concat,
                }
            )
            del self.globals["lipsum"]  # lipsum(n) loops n paragraphs in Python with no check

        def _parse(self, source: str, name: str | None, filename: str | None) -> Any:
            tree = super()._parse(source, name, filename)
            for node in tree.find_all((nodes.Name, nodes.Macro)):  # a template must not shadow a guard
                if str(getattr(node, "name", "")).startswith(_RESERVED):
                    raise ChatTemplateError(
                        f"the chat template uses the reserved name {getattr(node, 'name', '')!r}"
                    )
            for loop in tree.find_all(nodes.For):
                loop.iter = nodes.Call(
                    nodes.Name(f"{_RESERVED}iter", "load"), [loop.iter], [], None, None, lineno=loop.lineno
                )
            for concat in list(tree.find_all(nodes.Concat)):
                call = nodes.Call(
                    nodes.Name(f"{_RESERVED}concat", "load"),
                    concat.nodes,
                    [],
                    None,
                    None,
                    lineno=concat.lineno,
                )
                concat.nodes = [call]  # a one-part Concat of the checked join: same value
            return tree

        @staticmethod
        def concat(parts: Iterable[Any]) -> str:
            budget = _budget()
            pieces = list(parts)
            budget.size(sum(len(p) for p in pieces), "a captured block")
            return "".join(pieces)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            budget = _budget()
            budget.tick()
            _check_int_args(budget, (*args, *kwargs.values()))
            target = getattr(__obj, "__self__", None)
            budget.size(_estimate_call(getattr(__obj, "__name__", ""), target, args), "a call's result")
            return _check_value(budget, super().call(__context, __obj, *args, **kwargs), "a call's result")

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            budget = _budget()
            budget.tick()
            ints = type(left) is int and type(right) is int
            if operator == "*":
                if ints:
                    bits = left.bit_length() + right.bit_length()
                    if bits > _MAX_INT_BITS:
                        raise ChatTemplateError(f"the chat template multiplies to a {bits}-bit integer")
                elif type(right) is int or type(left) is int:
                    count, seq = (right, left) if type(right) is int else (left, right)
                    budget.size(
                        max(count, 0) * _length(seq), "a repeated sequence", items=not isinstance(seq, str)
                    )
            elif operator == "**" and ints and abs(left) > 1 and right > 0:
                bits = right * math.log2(abs(left))
                if bits > _MAX_INT_BITS:
                    raise ChatTemplateError(f"the chat template computes a {bits:.0f}-bit power")
            elif operator == "%" and isinstance(left, str):
                _check_format(budget, left)
            elif operator == "+":
                items = not isinstance(left, str)
                budget.size(_length(left) + _length(right), "a sum of sequences", items=items)
            return _check_value(
                budget, super().call_binop(context, operator, left, right), "an operator's result"
            )

        def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None
            fmt = str(value.__self__)

            def checked(*args: Any, **kwargs: Any) -> str:
                _check_format(_budget(), fmt)
                return wrapped(*args, **kwargs)

            return checked

    return BoundedEnvironment


def _as_chat_error(error: BaseException) -> ChatTemplateError:
    if isinstance(error, ChatTemplateError):
        return error
    if isinstance(error, RecursionError):
        return ChatTemplateError("the chat template recursed too deeply")
    return ChatTemplateError(f"the chat template failed: {type(error).__name__}: {error}")


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> Any:
    """The compiled template (cached by source). ChatTemplateError for a syntax error, a
    template that uses a reserved name, or one too deeply nested to compile."""
    if not isinstance(source, str):
        raise ChatTemplateError(f"a chat template is a string, not {type(source).__name__}")
    try:
        return _environment_class()().from_string(source)
    except Exception as error:  # TemplateSyntaxError, RecursionError, MemoryError, ...
        raise _as_chat_error(error) from error


def render_chat_template(
    source: str,
    context: dict[str, Any],
    *,
    max_seconds: float = MAX_RENDER_SECONDS,
    max_output_chars: int = MAX_OUTPUT_CHARS,
    max_collection_items: int = MAX_COLLECTION_ITEMS,
    max_loop_iterations: int = MAX_LOOP_ITERATIONS,
) -> str:
    """Render ``source`` with ``context`` (``messages``, ``add_generation_prompt``, ...) within
    the bounds above. Raises ChatTemplateError for any failure of the template."""
    template = compile_chat_template(source)
    budget = _Budget(
        time.monotonic() + max_seconds, max_output_chars, max_collection_items, max_loop_iterations
    )
    token = _CURRENT.set(budget)
    try:
        pieces: list[str] = []
        total = 0
        for piece in template.generate(**context):
            total += len(piece)
            budget.size(total, "an output")
            budget.tick()
            pieces.append(piece)
        return "".join(pieces)
    except Exception as error:  # every template failure is the template's: one typed error
        raise _as_chat_error(error) from error
    finally:
        _CURRENT.reset(token)
