"""Render Hugging Face-style chat templates (Jinja2) in a sandbox.

Templates come from model files we did not write, so they run in Jinja's immutable sandbox: no
attribute walks to `__class__`/`__globals__`, no mutating the messages, no `range` past 100,000, and here no
`*` or `**` whose result would run past MAX_SIZE items or bits, no padding wider than that (`ljust`, `center`,
a `%`, `|format` or `str.format` width or precision), no joined text (`~`, `+`) or rendered text past MAX_RENDER
characters, no render longer than RENDER_SECONDS (nested loops, each within range's bound), and, behind all of
these, no render that grows the process by more than MAX_MEMORY bytes (what a bound above misses, e.g. a
`replace` of every character by a long text, fails on its first allocation past it instead of taking the
machine's memory). Whatever a template's code raises is one error line, never a traceback. The environment mirrors the one
`transformers` uses (trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now`,
a `tojson` that keeps non-ASCII text, `{% generation %}` blocks) so templates render byte-for-byte the same.
"""

from __future__ import annotations

import json
import re
import signal
import string
import threading
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from llmrun.errors import LlmrunError


def _raise_exception(message: str) -> None:
    # Templates call this to reject a conversation (e.g. "roles must alternate"); the message is for the user.
    raise LlmrunError(f"chat template error: {message}")


def _tojson(value: Any, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    # Jinja's built-in tojson escapes non-ASCII and HTML characters; HF templates expect plain JSON.
    _check_width(indent)
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


MAX_SIZE = 1 << 20  # the most items (characters) a `*` may make, and bits a `**`, and the widest padding
MAX_RENDER = 1 << 24  # the most characters a render, or a text joined in it, may make (a 128k-token prompt is ~0.5M)
MAX_MEMORY = 1 << 30  # the most bytes a render may grow the process's address space by (Linux)
RENDER_SECONDS = 10.0  # the longest a render may take (real templates take milliseconds)
_WIDTHS = frozenset({"ljust", "rjust", "center", "zfill", "expandtabs"})  # str methods whose argument is a width


class _TooSlow(Exception):
    pass


class _Generator(CodeGenerator):
    """Jinja's code generator, with a text joined by `~` built by the sandbox's `concat` (so bounded)."""

    def visit_Concat(self, node, frame) -> None:
        if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:  # (never so here: no autoescape)
            return super().visit_Concat(node, frame)
        self.write("environment.concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with `*`, `**`, `%`, `+` and `~` bounded: `"x" * 10**10` would take the memory,
    not render."""

    code_generator_class = _Generator
    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def concat(self, parts) -> str:
        texts = [str(part) for part in parts]
        _check_joined(sum(map(len, texts)))
        return "".join(texts)

    def call_binop(self, context, operator: str, left, right):
        if operator == "%":
            if isinstance(left, str):
                _check_printf(left, right)
        elif operator == "+":
            if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                _check_joined(len(left) + len(right))
        elif operator == "*":
            count = next((n for n in (left, right) if isinstance(n, int)), 1)
            items = next((len(x) for x in (left, right) if isinstance(x, (str, list, tuple))), 0)
            if items * count > MAX_SIZE:
                raise SecurityError(f"a repetition of {items * count:,} items exceeds the sandbox's {MAX_SIZE:,}")
        elif isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and \
                left.bit_length() * right > MAX_SIZE:
            raise SecurityError(f"a power of {right:,} is too large for the sandbox")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # (jinja's own signature: names a template cannot pass)
        if isinstance(getattr(__obj, "__self__", None), str) and getattr(__obj, "__name__", "") in _WIDTHS:
            _check_width(args[0] if args else 0)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value):
        """`str.format`/`format_map`, its fields' widths and precisions bounded (`'{:>9999999999}'.format(1)`)."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        text = value.__self__

        def checked(*args, **kwargs):
            _check_format(text, args, kwargs)
            return wrapped(*args, **kwargs)
        return checked


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks an assistant reply for training tools (transformers'
    assistant mask); rendering a prompt, the block is its body's text."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def _check_width(width) -> None:
    if isinstance(width, int) and width > MAX_SIZE:
        raise SecurityError(f"a width of {width:,} exceeds the sandbox's {MAX_SIZE:,}")


def _check_digits(digits: str) -> None:
    """A width or precision written in a format (a digit run longer than MAX_SIZE's is past it, unread)."""
    if len(digits) > len(str(MAX_SIZE)) or int(digits) > MAX_SIZE:
        raise SecurityError(f"a format width or precision of {digits[:20]}{'...' if len(digits) > 20 else ''} "
                            f"exceeds the sandbox's {MAX_SIZE:,}")


def _check_values(values) -> None:
    """A width or precision taken from the values (`%*d`, `{:{}}`): every integer among them bounded."""
    if isinstance(values, dict):
        values = values.values()
    elif not isinstance(values, (tuple, list)):
        values = (values,)
    for value in values:
        if isinstance(value, int):
            _check_width(abs(value))


def _check_joined(length: int) -> None:
    if length > MAX_RENDER:
        raise SecurityError(f"a joined text of {length:,} characters exceeds the sandbox's {MAX_RENDER:,}")


_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")  # a printf conversion's width, precision


def _check_printf(text: str, values) -> None:
    """`text % values` (or `text|format(...)`), each conversion's width and precision bounded."""
    for match in _PRINTF.finditer(text):
        for part in match.groups():
            if part == "*":
                _check_values(values)
            elif part:
                _check_digits(part)


def _check_format(text: str, args, kwargs) -> None:
    """`text.format(*args, **kwargs)`: each field's spec bounded, nested fields (`{:{}}`) by the values."""
    for _, _, spec, _ in string.Formatter().parse(text):
        if spec:
            if "{" in spec:
                _check_values(args)
                _check_values(kwargs)
                for value in args:  # format_map's mapping
                    if isinstance(value, dict):
                        _check_values(value)
            for digits in re.findall(r"\d+", spec):
                _check_digits(digits)


def _format(value, *args, **kwargs):
    """Jinja's `format` filter (`value % args`), bounded as `%` is."""
    _check_printf(str(value), kwargs or args)
    return jinja2.filters.do_format(value, *args, **kwargs)


def _bounded(filter_):
    """A filter whose second argument is a width (`center`, `indent`), refused past MAX_SIZE."""
    def checked(value, width=80, *args, **kwargs):
        _check_width(width)
        return filter_(value, width, *args, **kwargs)
    return checked


@contextmanager
def _memory_limit(extra: int):
    """Cap the process's address space at `extra` bytes past what it maps now, in the block (Linux's
    RLIMIT_AS): an allocation past it fails at once with a MemoryError, where otherwise a render could take
    the machine's memory and, in one C call, outlast the time limit. The limit before it is put back after. The
    limit is the process's: set only from the main thread, as the timer is (a render in another thread would
    hold every thread to it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        import resource

        with open("/proc/self/statm") as statm:
            mapped = int(statm.read().split()[0]) * resource.getpagesize()
        before = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError, IndexError):  # not Linux
        yield
        return
    soft, hard = before
    cap = mapped + extra
    if (soft != resource.RLIM_INFINITY and soft <= cap) or (hard != resource.RLIM_INFINITY and hard <= cap):
        yield  # a tighter limit is already set
        return
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, before)


@contextmanager
def _time_limit(seconds: float):
    """Raise _TooSlow in the block after `seconds` (SIGALRM: the main thread only, where there are timers); the
    timer and handler before it are put back after."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise _TooSlow

    previous = signal.signal(signal.SIGALRM, expire)
    before, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if before:  # a timer that was running (a Ctrl-C held during an import: llmrun.entry)
            signal.setitimer(signal.ITIMER_REAL, before)


def _environment() -> jinja2.Environment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _Generation])
    env.filters["tojson"] = _tojson
    for name in ("center", "indent"):
        env.filters[name] = _bounded(env.filters[name])
    env.filters["format"] = _format
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _one_line(exc: Exception) -> str:
    text = " ".join(str(getattr(exc, "message", None) or exc).split()) or type(exc).__name__
    lineno = getattr(exc, "lineno", None)
    return f"chat template error: {text}" + (f" (template line {lineno})" if lineno else "")


class ChatTemplate:
    """One compiled chat template; compile once, render per conversation."""

    def __init__(self, source: str):
        try:
            self._template = _environment().from_string(source)
        except Exception as exc:  # a syntax error; a template nested past the parser's recursion
            raise LlmrunError(_one_line(exc)) from None

    def render(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        bos_token: str = "",
        eos_token: str = "",
        **extra: Any,
    ) -> str:
        """`extra` passes further template variables through (e.g. `tools`, `date_string`)."""
        try:
            with _time_limit(RENDER_SECONDS), _memory_limit(MAX_MEMORY):
                chunks, size = [], 0
                for chunk in self._template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                     bos_token=bos_token, eos_token=eos_token, **extra):
                    size += len(chunk)
                    if size > MAX_RENDER:
                        raise LlmrunError(f"chat template error: its text runs past {MAX_RENDER:,} characters")
                    chunks.append(chunk)
                return "".join(chunks)
        except LlmrunError:  # raise_exception: the template's own message
            raise
        except _TooSlow:
            raise LlmrunError(f"chat template error: rendering it takes more than {RENDER_SECONDS:g} s") from None
        except MemoryError:
            raise LlmrunError(f"chat template error: rendering it takes more than the sandbox's "
                              f"{MAX_MEMORY >> 30} GiB of memory") from None
        # the sandbox's SecurityError; `None + 'text'` where a message lacks the content the template expects;
        # a division by zero, a recursion without end...: the template's code failed, whatever it raised
        except Exception as exc:
            raise LlmrunError(_one_line(exc)) from None
