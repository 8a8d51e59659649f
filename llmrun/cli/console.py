"""What every command shares: the stderr console, the error boundary, loading with a spinner, the status line."""

import functools
import sys
from contextlib import nullcontext

import typer
from rich.console import Console
from rich.text import Text

from llmrun.errors import LlmrunError

# stdout carries only generated text and --json; everything else goes here.
err = Console(stderr=True, highlight=False, soft_wrap=True)


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
        except LlmrunError as e:
            fail(str(e))
        except KeyboardInterrupt:
            err.print("interrupted")
            raise typer.Exit(130)
        except (MemoryError, RuntimeError) as e:
            if not _is_out_of_memory(e):
                raise
            detail = (str(e).splitlines() or [type(e).__name__])[0][:160]
            fail(f"out of memory ({detail}); try a smaller --ctx, --dtype bf16, or a smaller model")

    return wrapper


def spinner(message: str):
    """A transient spinner on stderr, only when a person is watching it."""
    return err.status(message, spinner="dots") if err.is_terminal else nullcontext()


def open_engine(model: str, opts):
    """Load `model` as the options say and give back an Engine with its KV cache allocated."""
    from llmrun.generate import Engine
    from llmrun.loading import load_weights, open_model

    from .options import DEFAULT_CTX_CAP

    if opts.threads:
        import torch

        torch.set_num_threads(opts.threads)
    with spinner(f"loading {model}"):
        files = open_model(model)
        trained = files.config.max_seq_len
        if opts.ctx is not None and opts.ctx > trained:
            raise LlmrunError(f"--ctx {opts.ctx} exceeds the {trained} tokens the model was trained for")
        loaded = load_weights(files, device=opts.device, dtype=opts.dtype, weights=opts.weights)
    for warning in [*loaded.tokenizer.warnings, *loaded.notes]:
        err.print(Text(f"warning: {warning}", style="yellow"))
    engine = Engine(loaded, opts.ctx or min(trained, DEFAULT_CTX_CAP))
    if opts.draft is not None or opts.ngram is not None:
        engine.speculator = _speculator(engine, opts)
    return engine


def _speculator(engine, opts):
    from llmrun.loading import load_weights, open_model
    from llmrun.speculative import make_speculator

    def load(spec):
        with spinner(f"loading draft {spec}"):
            loaded = load_weights(open_model(spec), device=opts.device, dtype=opts.dtype, weights=opts.weights)
        for warning in loaded.notes:
            err.print(Text(f"warning: draft: {warning}", style="yellow"))
        return loaded

    return make_speculator(engine, draft=opts.draft, ngram=opts.ngram, draft_tokens=opts.draft_tokens,
                           adaptive=opts.adaptive, load=load)


def status_line(stats, memory: dict) -> Text:
    """One line: speed, tokens, context, memory."""
    from llmrun.memory import human_bytes

    parts = [
        f"{stats.new_tokens} tok",
        f"{stats.decode_tok_s:.1f} tok/s",
        f"prefill {stats.prefilled_tokens} @ {stats.prefill_tok_s:.0f} tok/s"
        + (f" (+{stats.reused_tokens} cached)" if stats.reused_tokens else ""),
        f"ctx {stats.context_used}/{stats.context_max}",
    ]
    if stats.draft_k is not None:  # speculative decoding
        rate = stats.acceptance_rate
        parts.append(f"accepted {'-' if rate is None else f'{rate:.0%}'}, {stats.tokens_per_step or 0:.2f} tok/step, K {stats.draft_k}")
    parts += [
        f"weights {human_bytes(memory['weights'])}",
        f"KV {human_bytes(memory['kv_in_use'])}/{human_bytes(memory['kv_allocated'])}",
    ]
    if "draft_weights" in memory:
        parts.append(f"draft {human_bytes(memory['draft_weights'] + memory['draft_kv_allocated'])}")
    if "device_peak_allocated" in memory:
        parts.append(f"GPU peak {human_bytes(memory['device_peak_allocated'])}")
    parts.append(f"peak {human_bytes(memory['process_peak_rss'])}")
    if stats.finish_reason in ("length", "context", "interrupted"):
        parts.append({"length": "stopped: --max-new-tokens", "context": "stopped: context full",
                      "interrupted": "interrupted"}[stats.finish_reason])
    return Text(" · ".join(parts), style="dim")


def print_json_when_done(reply, engine, **fields) -> None:
    """Run the reply to its end, then print one JSON document: `fields`, its text, stats and memory. After
    Ctrl-C the partial reply is still printed; after an error, nothing is (the error line says it all)."""
    import json

    from llmrun.memory import memory_report

    def emit():
        doc = {**fields, "text": reply.text, **reply.stats.as_dict(), "memory": memory_report(engine)}
        print(json.dumps(doc, ensure_ascii=False))

    try:
        for _ in reply:
            pass
    except KeyboardInterrupt:
        emit()
        raise
    emit()


def stream_to_stdout(reply) -> None:
    """Write the reply's pieces to stdout as they come; a spinner on stderr until the first one.
    Ctrl-C propagates (after closing the generation, so its stats are final)."""
    pieces = iter(reply)
    try:
        with spinner("thinking"):
            first = next(pieces, None)
        if first is not None:
            sys.stdout.write(first)
            sys.stdout.flush()
            for piece in pieces:
                sys.stdout.write(piece)
                sys.stdout.flush()
    finally:
        pieces.close()
    if reply.text and not reply.text.endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()
