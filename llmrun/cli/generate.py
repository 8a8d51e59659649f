"""`llmrun generate`: raw completion of a text, without a chat template."""

import sys
from typing import Annotated

import typer

from llmrun.errors import LlmrunError, UsageError, check_utf8, read_stdin
from llmrun.loading import DEFAULT_MODEL

from . import app
from .console import Terminated, end_line, err, open_engine, print_json_when_done, status_line, stream_to_stdout, user_errors
from .options import JsonFlag, run_options


def _complete_model_first(ctx: typer.Context, incomplete: str):
    """Shell completion: the first word of [MODEL] TEXT may be a model; the text is the user's."""
    from llmrun.catalog import complete_model

    return [] if ctx.params.get("args") else complete_model(incomplete)


def _text_from_stdin(kwargs: dict) -> str | None:
    args = kwargs.get("args") or []
    if not args or (len(args) <= 2 and args[-1] == "-"):
        return "the text and the constraint (-) both come from stdin; name a file for one of them"
    return None


@app.command()
@user_errors
@run_options(stdin_conflict=_text_from_stdin)
def generate(
    args: Annotated[list[str], typer.Argument(metavar="[MODEL] TEXT", help=f"Model (default '{DEFAULT_MODEL}') and the text to continue; '-' or no TEXT reads stdin.", show_default=False, autocompletion=_complete_model_first)] = None,
    json_out: JsonFlag = False,
    special: Annotated[bool, typer.Option(help="Parse special tokens written in TEXT (e.g. <|im_start|>).")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No status line on stderr.")] = False,
    *,
    opts,
):
    """Continue TEXT with the model: plain completion, no chat template (for scripts and tests)."""
    from llmrun.memory import memory_report

    args = list(args or [])
    if len(args) > 2:
        raise UsageError(f"expected [MODEL] TEXT, got {len(args)} arguments (quote the text)")
    model = args.pop(0) if len(args) == 2 else DEFAULT_MODEL
    text = args[0] if args else "-"
    if text == "-":
        if sys.stdin.isatty():
            raise LlmrunError("- reads the text from stdin, but stdin is a terminal; pipe the text in or pass it as an"
                              " argument" if args else "no TEXT given; pass it as an argument or on stdin")
        text = read_stdin()
    if not text:
        raise LlmrunError("the text to continue is empty")
    check_utf8(text)  # before the model loads
    engine = open_engine(model, opts)
    prompt = engine.tokenizer.encode(text, special=special)
    reply = engine.generate(prompt, opts.params)
    if json_out:
        print_json_when_done(reply, engine, model=model, token_ids=reply.token_ids)
        return
    try:
        stream_to_stdout(reply)
    except (KeyboardInterrupt, Terminated):
        end_line(reply)
        raise
    if not quiet:
        err.print(status_line(reply.stats, memory_report(engine)))
