"""What every command shares: the stderr console, the error boundary, spinners and progress bars, loading, the
status line."""

import functools
import importlib
import io
import os
import signal
import stat
import sys
from contextlib import contextmanager, nullcontext

import typer
from rich.console import Console
from rich.text import Text

from llmrun import threads
from llmrun.errors import LlmrunError, UnsupportedModelError, UsageError

# click's context, or that of Typer's vendored copy of click (Typer >= 0.26)
current_context = importlib.import_module(sys.modules[typer.BadParameter.__module__].__package__ + ".globals").get_current_context

# stdout carries only generated text and --json; everything else goes here.
err = Console(stderr=True, highlight=False, soft_wrap=True)
if not err.is_terminal and "COLUMNS" not in os.environ:
    err.width = 200  # a log or a pipe: tables as wide as their cells, not cut at 80 columns
LOG_EVERY_S = 30.0  # with stderr not a terminal, a long wait reports its progress on a line this often


class OutputError(LlmrunError):
    """Standard output refused a write (`> /dev/full`, a disk that filled up): nothing more can be shown."""


def write_out(text: str) -> None:
    """Write `text` to stdout now. A stdout that fails becomes OutputError (and points at nothing, so that Python's
    last flush cannot fail again); a reader gone away stays BrokenPipeError, which `user_errors` answers."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        silence_stdout()
        raise OutputError(f"cannot write to standard output ({e.strerror or e})") from None


def silence_stdout() -> None:
    """Point stdout at nothing, so that what is still buffered, and Python's last flush, cannot fail again."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, sys.stdout.fileno())
    os.close(null)


def fail(message: str, code: int = 1):
    err.print(Text(f"error: {message}", style="bold red"))
    raise typer.Exit(code)


def _is_out_of_memory(e: BaseException) -> bool:
    import torch

    if isinstance(e, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("can't allocate memory" in text or "not enough memory" in text)


def user_errors(command):
    """Turn the errors a user can cause into one `error:` line and a non-zero exit; others keep their traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except UsageError as e:  # as the parser's own usage errors read
            ctx = current_context(silent=True)
            fail(f"{e} (see: {ctx.command_path} --help)" if ctx else str(e), 2)
        except LlmrunError as e:
            fail(str(e))
        except KeyboardInterrupt:
            err.print("interrupted")
            raise typer.Exit(130)
        except BrokenPipeError:  # the reader of stdout went away (`| head`): stop quietly, as SIGPIPE would stop a
            # C program (128 + 13), with stdout pointed at nothing so that Python's last flush cannot fail again
            if not _stdout_is_a_pipe():
                raise
            silence_stdout()
            raise typer.Exit(141)
        except (MemoryError, RuntimeError) as e:
            if not _is_out_of_memory(e):
                raise
            detail = (str(e).splitlines() or [type(e).__name__])[0][:160]
            fail(f"out of memory ({detail}); try a smaller --ctx, --dtype bf16, or a smaller model")

    return wrapper


def _stdout_is_a_pipe() -> bool:
    try:
        mode = os.fstat(sys.stdout.fileno()).st_mode
    except (OSError, ValueError):
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


@contextmanager
def signals_held():
    """Hold Ctrl-C, SIGTERM and SIGHUP off while a turn is kept and saved, so that none cuts the saving short (and
    loses the turn). A Ctrl-C then is dropped: the reply it meant to stop is over. The others are delivered when
    the block is done, to their own handlers."""
    caught, previous = [], {}
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        number = getattr(signal, name, None)  # (no SIGHUP on Windows)
        try:
            if number is not None:
                previous[number] = signal.signal(number, lambda signum, frame: caught.append(signum))
        except ValueError:  # not the main thread, where signals are not delivered anyway
            break
    try:
        yield
    finally:
        for number, handler in previous.items():  # (None: a handler set outside Python, which cannot be put back)
            signal.signal(number, signal.SIG_DFL if handler is None else handler)
        for number in dict.fromkeys(caught):
            if number != signal.SIGINT:
                signal.raise_signal(number)


def spinner(message: str):
    """A transient spinner on stderr, only when a person is watching it."""
    return err.status(message, spinner="dots") if err.is_terminal else nullcontext()


@contextmanager
def progress_bar(description: str):
    """A transient progress bar on stderr while a person watches it. Yields `update(done, total, what="")`: `total`
    None while unknown, `what` the step under way (shown after the times). When stderr is not a terminal, nothing
    is drawn: a long wait writes a line now and then (`_progress_lines`)."""
    if not err.is_terminal:
        with _progress_lines(description) as update:
            yield update
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn(), TextColumn("{task.fields[what]}", style="dim", markup=False))
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task(description, total=None, what="")
        yield lambda done, total, what="": bar.update(task, completed=done, total=total, what=what)


@contextmanager
def _progress_lines(description: str):
    """`progress_bar`'s `update` for a log: nothing for a short wait; a line every LOG_EVERY_S seconds of a long one
    (an AWQ search runs for an hour), with the latest count and step: at an update when a line is due, and from a
    thread that wakes when one is due between updates (a timed `llmrun bench` run updates only at its end). With
    LOG_EVERY_S 0, a line at each update alone."""
    import threading
    import time

    start = time.monotonic()
    state = {"last": start, "count": "", "what": ""}
    lock, stop = threading.Lock(), threading.Event()

    def line_if_due() -> None:
        with lock:
            now = time.monotonic()
            if now - state["last"] >= LOG_EVERY_S:
                state["last"] = now
                count, what = state["count"], state["what"]
                err.print(f"{description}: {count + ' ' if count else ''}after {now - start:.0f} s"
                          + (f" ({what})" if what else ""))

    def update(done, total, what=""):
        with lock:
            state.update(count=f"{done}/{total}" if total else str(done), what=what)
        line_if_due()

    def watch() -> None:  # wakes when the next line is due
        while not stop.wait(max(state["last"] + LOG_EVERY_S - time.monotonic(), 0.01)):
            line_if_due()

    watcher = threading.Thread(target=watch, name="progress lines", daemon=True) if LOG_EVERY_S > 0 else None
    if watcher is not None:
        watcher.start()
    try:
        yield update
    finally:
        stop.set()
        if watcher is not None:
            watcher.join()


def hub_bars(watched: bool) -> None:
    """huggingface_hub draws download bars of its own: for a pipe or a log, turn them off (ours replace them on a
    terminal, `rich_tqdm`). An HF_HUB_DISABLE_PROGRESS_BARS the user set wins."""
    if watched or "HF_HUB_DISABLE_PROGRESS_BARS" in os.environ:
        return
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read when huggingface_hub is imported
    if "huggingface_hub" in sys.modules:  # imported already: its switch
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


def rich_tqdm():
    """A tqdm class for huggingface_hub's downloads that draws each of its bars as our Rich bar (`progress_bar`):
    tqdm still counts the bytes, Rich shows them."""
    from tqdm.auto import tqdm  # huggingface_hub's own dependency

    from llmrun.memory import human_bytes

    class RichTqdm(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)  # huggingface_hub's tqdm takes a name (for its on/off switches); tqdm does not
            kwargs.update(file=io.StringIO(), disable=False)  # counted by tqdm, drawn by Rich
            super().__init__(*args, **kwargs)
            self._bar = progress_bar(f"downloading {self.desc or 'files'}".rstrip(": "))
            self._show = self._bar.__enter__()
            self._show(self.n, self.total)

        def update(self, n=1):
            shown = super().update(n)
            total = f" of {human_bytes(self.total)}" if self.total else ""
            self._show(self.n, self.total, f"{human_bytes(self.n)}{total}" if self.unit == "B" else "")
            return shown

        def close(self):
            if getattr(self, "_bar", None) is not None:
                bar, self._bar = self._bar, None
                bar.__exit__(None, None, None)
            super().close()

    return RichTqdm


def model_source(spec: str):
    """Resolve MODEL (`loading.resolve`); a hub id is downloaded into the local cache first, with a Rich bar on a
    terminal, before any other bar of ours starts, so two never draw over each other."""
    from llmrun.loading import resolve

    hub_bars(watched=err.is_terminal)
    ours = err.is_terminal and os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "").lower() not in ("1", "true", "yes", "on")
    return resolve(spec, rich_tqdm() if ours else None)


def open_files(spec: str):
    """`loading.open_model` of MODEL (config, tokenizer, tensor index: torch's import and the tokenizer take a
    second or two) with a spinner, after `model_source`."""
    from llmrun.loading import open_model

    source = model_source(spec)
    with spinner(f"reading {spec}"):
        return open_model(source)


def load_with_progress(spec: str, opts, label: str, check=None):
    """`spec` loaded as `opts` say (device, dtype, weights), with a progress bar over the tensors read, dequantized
    or packed. `check(files)` runs before any weight is read, to fail fast."""
    from llmrun.loading import load_weights, open_model

    source = model_source(spec)
    with progress_bar(label) as update:
        files = open_model(source)
        if check is not None:
            check(files)
        return load_weights(files, device=opts.device, dtype=opts.dtype, weights=opts.weights, on_progress=update)


def open_engine(model: str, opts):
    """Load `model` as the options say and give back an Engine with its KV cache allocated."""
    from llmrun.generate import Engine

    from .options import DEFAULT_CTX_CAP

    if opts.threads:
        threads.set_threads(opts.threads)  # (the thread governor's ceiling too)
    if opts.eviction is not None and opts.ctx is not None:
        raise UsageError(f"--ctx {opts.ctx} with --kv-evict: an evicting cache holds --kv-budget tokens and the"
                         " conversation has no length limit; drop --ctx")

    def check_ctx(files):  # (and the cache's format): before the weights load
        from llmrun.kv_cache import unsupported

        trained = files.config.max_seq_len
        if opts.ctx is not None and opts.ctx > trained:
            raise UsageError(f"--ctx {opts.ctx} exceeds the model's context of {trained} tokens")
        if (why := unsupported(files.config, opts.kv)) is not None:
            raise UnsupportedModelError(why)

    loaded = load_with_progress(model, opts, f"loading {model}", check=check_ctx)
    trained = loaded.config.max_seq_len
    for warning in [*loaded.tokenizer.warnings, *loaded.notes]:
        err.print(Text(f"warning: {warning}", style="yellow"))
    engine = Engine(loaded, opts.ctx or min(trained, DEFAULT_CTX_CAP), kv_format=opts.kv, eviction=opts.eviction)
    if opts.draft is not None or opts.ngram is not None:
        engine.speculator = _speculator(engine, opts)
    if opts.grammar is not None:
        from llmrun.grammar import compile_grammar

        engine.grammar = compile_grammar(opts.grammar, engine.tokenizer, engine.model.config.vocab_size, opts.jump_forward)
        for warning in engine.grammar.warnings:
            err.print(Text(f"warning: {engine.grammar.spec.describe()}: {warning}", style="yellow"))
    return engine


def _speculator(engine, opts):
    from llmrun.speculative import make_speculator, short_draft_note

    def load(spec):
        loaded = load_with_progress(spec, opts, f"loading draft {spec}")
        for warning in loaded.notes:
            err.print(Text(f"warning: draft: {warning}", style="yellow"))
        return loaded

    speculator = make_speculator(engine, draft=opts.draft, ngram=opts.ngram, draft_tokens=opts.draft_tokens,
                                 adaptive=opts.adaptive, load=load)
    note = short_draft_note(engine, speculator)
    if note is not None:
        err.print(Text(f"warning: {note}", style="yellow"))
    return speculator


def status_line(stats, memory: dict) -> Text:
    """One line: speed, tokens, context, memory."""
    from llmrun.memory import human_bytes

    prefill = "prefill interrupted"  # (Ctrl-C before it ended)
    if stats.prefill_s:
        prefill = f"prefill {stats.prefilled_tokens} @ {stats.prefill_tok_s:.0f} tok/s"
        prefill += f" (+{stats.reused_tokens} cached)" if stats.reused_tokens else ""
    parts = [
        f"{stats.new_tokens} tok",
        f"{stats.decode_tok_s:.1f} tok/s",
        prefill,
        f"ctx {stats.context_used}/{stats.context_max}",
    ]
    if stats.draft_k is not None:  # speculative decoding
        rate = stats.acceptance_rate
        parts.append(f"accepted {'-' if rate is None else f'{rate:.0%}'}, {stats.tokens_per_step or 0:.2f} tok/step, K {stats.draft_k}")
    if stats.constrained:  # structured output
        parts.append(f"grammar: {stats.forced} forced, {stats.new_tokens - stats.forced} sampled,"
                     f" {stats.mask_us_per_token or 0:.0f} µs/tok")
    parts += [
        f"weights {human_bytes(memory['weights'])}",
        f"KV {human_bytes(memory['kv_in_use'])}/{human_bytes(memory['kv_allocated'])} {memory['kv_format']}"
        + (f" ({memory['kv_compression']:.1f}x vs fp16)" if memory["kv_compression"] else ""),
    ]
    if "draft_weights" in memory:
        parts.append(f"draft {human_bytes(memory['draft_weights'] + memory['draft_kv_allocated'])}")
    if "device_peak_allocated" in memory:
        parts.append(f"GPU peak {human_bytes(memory['device_peak_allocated'])}")
    parts.append(f"peak {human_bytes(memory['process_peak_rss'])}")
    if (reduced := threads.reduced()) is not None:  # other processes hold cores: `llmrun.threads`
        parts.append(f"threads {reduced[0]}/{reduced[1]} (CPU busy)")
    if stats.finish_reason in ("length", "context", "interrupted"):
        parts.append({"length": "stopped: --max-new-tokens", "context": "stopped: context full",
                      "interrupted": "interrupted"}[stats.finish_reason])
    elif stats.finish_reason == "stop" and not stats.new_tokens:
        parts.append("stopped: an end token first (an empty reply)")
    return Text(" · ".join(parts), style="dim")


class Terminated(BaseException):
    """SIGTERM, or SIGHUP (the terminal closed): unwinds like Ctrl-C, so that the reply under way is kept (and
    saved, with --save), the spinner gives the cursor back and the process exits 128 + the signal's number,
    instead of dying in the middle of a write."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def print_json_when_done(reply, engine, **fields) -> None:
    """Run the reply to its end, then print one JSON document: `fields`, its text, stats and memory. After
    Ctrl-C, SIGTERM or SIGHUP (`timeout N llmrun ... --json`) the partial reply is still printed; after an error,
    nothing is (the error line says it all)."""
    import json

    from llmrun.memory import memory_report

    def emit():
        doc = {**fields, "text": reply.text, **reply.stats.as_dict(), "memory": memory_report(engine)}
        write_out(json.dumps(doc, ensure_ascii=False) + "\n")

    try:
        for _ in reply:
            pass
    except (KeyboardInterrupt, Terminated):
        emit()
        raise
    emit()


def end_line(reply) -> None:
    """After a reply cut short (Ctrl-C), stdout ends its line as a whole reply's does (stdout gone too: the
    interruption is what to report)."""
    if not reply.text.endswith("\n"):
        try:
            write_out("\n")
        except OutputError:
            pass


def stream_to_stdout(reply) -> None:
    """Write the reply's pieces to stdout as they come; a spinner on stderr until the first one.
    Ctrl-C propagates (after closing the generation, so its stats are final)."""
    pieces = iter(reply)
    try:
        with spinner("thinking"):
            first = next(pieces, None)
        if first is not None:
            write_out(first)
            for piece in pieces:
                write_out(piece)
    finally:
        pieces.close()
    if not reply.text.endswith("\n"):  # (an empty reply too: a line of its own)
        write_out("\n")
