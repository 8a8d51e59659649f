"""`llmrun chat`: interactive multi-turn chat, or one turn with -p / piped stdin."""

import sys
from typing import Annotated, Optional

import typer
from rich.table import Table
from rich.text import Text

from llmrun.errors import LlmrunError
from llmrun.loading import DEFAULT_MODEL

from . import app
from .console import err, open_engine, print_json_when_done, status_line, stream_to_stdout, user_errors
from .options import JsonFlag, ModelArg, run_options

HELP = """Commands: /reset (forget the conversation), /system TEXT (set the system prompt; no TEXT clears it),
/stats (figures of the last reply and memory), /exit. Ctrl-C stops a reply; Ctrl-C or Ctrl-D at the prompt exits."""


@app.command()
@user_errors
@run_options
def chat(
    model: ModelArg = DEFAULT_MODEL,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="One turn: reply to this and exit (stdin works too).")] = None,
    system: Annotated[Optional[str], typer.Option(help="System prompt.")] = None,
    json_out: JsonFlag = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No status line on stderr.")] = False,
    *,
    opts,
):
    """Chat with a model. Interactive unless a prompt comes from -p/--prompt or stdin.

    Tokens stream as they are generated; a status line on stderr shows speed, context and memory.
    The KV cache of earlier turns is kept, so each turn prefills only its new tokens.
    """
    from llmrun.conversation import Conversation

    if prompt is None and not sys.stdin.isatty():
        prompt = sys.stdin.read().strip()  # `echo Q |` adds a newline that -p Q does not have
        if not prompt:
            raise LlmrunError("stdin was empty; give a prompt with -p or type one interactively")
    if json_out and prompt is None:
        raise LlmrunError("--json needs a prompt (-p TEXT or stdin)")
    engine = open_engine(model, opts)
    conversation = Conversation(engine, opts.params, system)
    if prompt is not None:
        _one_turn(conversation, prompt, model, json_out, quiet)
    else:
        _repl(conversation, quiet)


def _one_turn(conversation, prompt: str, model: str, json_out: bool, quiet: bool) -> None:
    from llmrun.memory import memory_report

    reply = conversation.send(prompt)
    if json_out:
        print_json_when_done(reply, conversation.engine, model=model)
        return
    stream_to_stdout(reply)
    if not quiet:
        err.print(status_line(reply.stats, memory_report(conversation.engine)))


def _read_line() -> str:
    if sys.stdout.isatty():  # readline must know the prompt to redraw the line while editing
        return input("\001\033[1;32m\002>>> \001\033[0m\002")
    err.print(Text(">>> ", style="bold green"), end="")  # stdout is redirected: keep it for replies only
    return input()


def _repl(conversation, quiet: bool) -> None:
    from llmrun.memory import memory_report

    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    err.print(Text(f"llmrun chat: {conversation.engine.loaded.files.source.spec} — /help for commands", style="dim"))
    last = None
    while True:
        try:
            line = _read_line()
        except (EOFError, KeyboardInterrupt):
            err.print()
            return
        if not line.strip():
            continue
        if line.startswith("/"):
            if _slash(line, conversation, last):
                return
            continue
        try:
            reply = conversation.send(line)
        except LlmrunError as e:
            err.print(Text(f"error: {e}", style="bold red"))
            continue
        try:
            stream_to_stdout(reply)
        except KeyboardInterrupt:
            sys.stdout.write("\n")
        conversation.finish(reply)
        last = reply
        if not quiet:
            err.print(status_line(reply.stats, memory_report(conversation.engine)))


def _slash(line: str, conversation, last) -> bool:
    """Run a slash command; True means exit."""
    command, _, arg = line.partition(" ")
    if command in ("/exit", "/quit", "/bye"):
        return True
    if command == "/reset":
        conversation.reset()
        err.print(Text("conversation cleared", style="dim"))
    elif command == "/system":
        conversation.system = arg.strip() or None
        err.print(Text("system prompt " + ("set" if arg.strip() else "cleared"), style="dim"))
    elif command == "/stats":
        _print_stats(conversation, last)
    elif command == "/help":
        err.print(HELP)
    else:
        err.print(Text(f"unknown command {command}. {HELP}", style="yellow"))
    return False


def _print_stats(conversation, last) -> None:
    from llmrun.memory import human_bytes, memory_report

    table = Table(title="llmrun stats", show_header=False)
    if last is not None:
        for key, value in last.stats.as_dict().items():
            table.add_row(key, str(value))
    for key, value in memory_report(conversation.engine).items():
        table.add_row(f"memory.{key}", human_bytes(value))
    table.add_row("turns", str(sum(m["role"] == "user" for m in conversation.messages)))
    err.print(table)
