"""`llmrun chat`: interactive multi-turn chat, or one turn with -p / piped stdin."""

import os
import shlex
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table
from rich.text import Text

from llmrun.errors import LlmrunError, UsageError, check_utf8, read_stdin
from llmrun.loading import DEFAULT_MODEL

from . import app
from .console import (OutputError, Terminated, end_line, err, open_engine, print_json_when_done, signals_held,
                      status_line, stream_to_stdout, user_errors, write_out)
from .options import JsonFlag, ModelArg, run_options

HELP = """Commands: /reset (forget the conversation), /system TEXT (set the system prompt; no TEXT clears it),
/stats (figures of the last reply and memory), /save [FILE] (write the conversation to FILE, JSON; no FILE: the
file the last /save FILE or /load named, else --save's or --load's), /load FILE (continue a saved conversation),
/help (this), /exit. A message of several lines: end a line with \\ to go on at the next, or open the message with \"\"\" and
close it with \"\"\". Ctrl-C stops a reply (at a continuation prompt, drops the message); Ctrl-C or Ctrl-D at the
prompt exits."""
BLOCK = '"""'  # opens and closes a message of several lines
MORE = "... "  # the prompt of a message's next line


def _prompt_from_stdin(kwargs: dict) -> str | None:
    if kwargs.get("prompt") is None and not sys.stdin.isatty():
        return "the prompt and the constraint (-) both come from stdin; give the prompt with -p"
    return None


@app.command()
@user_errors
@run_options(stdin_conflict=_prompt_from_stdin)
def chat(
    click_context: typer.Context,
    model: ModelArg = DEFAULT_MODEL,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="One turn: reply to this and exit (stdin works too).")] = None,
    system: Annotated[Optional[str], typer.Option(help="System prompt.")] = None,
    save: Annotated[Optional[str], typer.Option("--save", metavar="FILE", help="Save the conversation to FILE (JSON) after every turn; a new file, unless --load names it too.", show_default=False)] = None,
    load: Annotated[Optional[str], typer.Option("--load", metavar="FILE", help="Continue the conversation saved in FILE: its messages, system prompt (unless --system) and model (unless MODEL).", show_default=False)] = None,
    template_kwargs: Annotated[Optional[str], typer.Option("--chat-template-kwargs", metavar="JSON", help="More variables for the chat template, a JSON object: '{\"enable_thinking\": false}' turns Qwen3's thinking off.", show_default=False)] = None,
    json_out: JsonFlag = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No status line on stderr.")] = False,
    *,
    opts,
):
    """Chat with a model. Interactive unless a prompt comes from -p/--prompt or stdin.

    Tokens stream as they are generated; a status line on stderr shows speed, context and memory.
    The KV cache of earlier turns is kept, so each turn prefills only its new tokens.
    Nothing is written to disk unless --save or /save asks for it.
    """
    from llmrun.conversation import Conversation

    if prompt is None and not sys.stdin.isatty():
        prompt = read_stdin().strip()  # `echo Q |` adds a newline that -p Q does not have
        if not prompt:
            raise LlmrunError("stdin was empty; give a prompt with -p or type one interactively")
    if prompt is not None and not prompt.strip():
        raise LlmrunError("the prompt is empty")
    if json_out and prompt is None:
        raise UsageError("--json needs a prompt (-p TEXT or stdin)")
    for text in (prompt, system):  # before the model loads
        if text is not None:
            check_utf8(text)
    variables = None if template_kwargs is None else _template_variables(template_kwargs)
    save, load = (_option_path(flag, value) for flag, value in (("--save", save), ("--load", load)))
    saved = _check_files(save, load)  # before the model loads
    if saved is not None:
        if click_context.get_parameter_source("model").name == "DEFAULT":
            model = saved.model
        elif _portable(model) != saved.model:
            err.print(Text(f"note: {load} was saved with {saved.model}; continuing with {model}", style="dim"))
    engine = open_engine(model, opts)
    if variables is None and saved is not None:
        variables = saved.template_variables  # (--chat-template-kwargs over the file's, as --system)
    conversation = Conversation(engine, opts.params, system if system is not None or saved is None else saved.system,
                                variables)
    if saved is not None:
        conversation.messages = list(saved.messages)
        if prompt is not None:  # no chat to /reset
            conversation.start_over = f"start over without --load {load}"
    saving = _Saving(_portable(model), every_turn=save, last=save or load)
    if prompt is not None:
        _one_turn(conversation, prompt, model, json_out, quiet, saving)
    else:
        if saved is not None:
            err.print(Text(f"continuing {_turns_text(conversation)} from {load}", style="dim"))
        _repl(conversation, quiet, saving)


def _template_variables(text: str) -> dict:
    """--chat-template-kwargs' JSON object, or a one-line error."""
    from llmrun.conversation import template_variables_problem
    from llmrun.errors import parse_json

    hint = "'--chat-template-kwargs'"
    check_utf8(text, "--chat-template-kwargs")
    try:
        value = parse_json(text)
    except ValueError as e:
        raise typer.BadParameter(f"is not JSON ({e})", param_hint=hint) from None
    if problem := template_variables_problem(value):
        raise typer.BadParameter(problem, param_hint=hint)
    return value


def _option_path(flag: str, value: str | None) -> Path | None:
    if value is not None and not value.strip():  # (as a Path, "" would be "."; an error said "--save .: a directory")
        raise typer.BadParameter("is empty; give a file name", param_hint=f"'{flag}'")
    return None if value is None else Path(value)


def _check_files(save: Path | None, load: Path | None):
    """The conversation --load names (or None), once --save's file is known to be writable without loss."""
    from llmrun.conversation import load_conversation

    saved = load_conversation(load) if load is not None else None
    if save is not None:
        if save.is_dir():
            raise LlmrunError(f"--save {save}: a directory; give a file name")
        if save.exists() and (load is None or save.resolve() != load.resolve()):
            try:
                load_conversation(save)
            except LlmrunError:
                raise LlmrunError(f"--save {save}: the file exists (and is not a conversation); choose another file") from None
            raise LlmrunError(f"--save {save}: the file exists; continue it with --load {save} --save {save}, or choose another file")
        if save.is_symlink() and not save.exists():
            raise LlmrunError(f"--save {save}: a symbolic link to a file that does not exist")
        if not save.parent.is_dir():
            raise LlmrunError(f"--save {save}: no directory {save.parent}")
        folder = Path(os.path.realpath(save)).parent  # (through a symbolic link, the file it names is written)
        try:  # a file can be made there (not a read-only or pseudo file system), before the model loads
            fd, probe = tempfile.mkstemp(prefix=f".{save.name}.", dir=folder)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise LlmrunError(f"--save {save}: cannot write in {folder} ({e.strerror or e})") from None
    return saved


def _portable(model: str) -> str:
    """MODEL as a saved conversation records it: a local path made absolute, so the file loads from anywhere."""
    path = Path(model).expanduser()
    return str(path.resolve()) if model != DEFAULT_MODEL and path.exists() else model


@dataclass
class _Saving:
    """Where the conversation goes on disk: nowhere unless asked."""

    model: str  # recorded in the file
    every_turn: Path | None = None  # --save: written after every turn
    last: Path | None = None  # where a bare /save writes: the last /save or /load FILE, else --save's or --load's
    ours: set = field(default_factory=set)  # files this session loaded or wrote: /save may overwrite only these

    def __post_init__(self):
        self.ours.update(p.resolve() for p in (self.every_turn, self.last) if p is not None)

    def claim(self, path: Path) -> None:
        """`path` is a file /save may write: one this session loaded or wrote, or none at all yet."""
        if path.is_dir():
            raise LlmrunError(f"/save {path}: a directory; give a file name")
        if path.exists() and path.resolve() not in self.ours:
            raise LlmrunError(f"/save {path}: the file exists and is not this conversation's; /load it first, or choose another file")

    def write(self, conversation, path: Path) -> None:
        from llmrun.conversation import SavedConversation, save_conversation

        save_conversation(path, SavedConversation(self.model, conversation.system, conversation.messages,
                                                  conversation.template_variables))

    def after_turn(self, conversation) -> None:
        if self.every_turn is not None:
            self.write(conversation, self.every_turn)


def _turns(conversation) -> int:
    return sum(m["role"] == "user" for m in conversation.messages)


def _turns_text(conversation) -> str:
    n = _turns(conversation)
    return f"{n} turn" + ("" if n == 1 else "s")


def _one_turn(conversation, prompt: str, model: str, json_out: bool, quiet: bool, saving: _Saving) -> None:
    from llmrun.memory import memory_report

    reply = conversation.send(prompt)
    try:
        if json_out:
            print_json_when_done(reply, conversation.engine, model=model)
        else:
            stream_to_stdout(reply)
    except BaseException as e:  # Ctrl-C, SIGTERM, a closed terminal, a crash: keep the partial reply, as the chat does
        _keep(conversation, reply, saving)
        if isinstance(e, (KeyboardInterrupt, Terminated)) and not json_out:
            end_line(reply)
        raise
    _keep(conversation, reply, saving)
    if not json_out and not quiet:
        err.print(status_line(reply.stats, memory_report(conversation.engine)))


def _read_line(prompt: str = ">>> ") -> str:
    if sys.stdout.isatty():  # readline must know the prompt to redraw the line while editing
        if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":  # as Rich's console obeys them
            return input(prompt)
        return input(f"\001\033[1;32m\002{prompt}\001\033[0m\002")
    err.print(Text(prompt, style="bold green"), end="")  # stdout is redirected: keep it for replies only
    return input()


def _read_message() -> tuple[str, str] | None:
    """The next message typed at the prompt and its kind ("message", "command": a slash command, or "system": the
    text of a `/system` block): one line, or several. A line
    ending in a backslash goes on at the next (the backslash dropped, the line break kept); a message opened with
    BLOCK (three double quotes) goes on until a line ending in BLOCK (the quotes dropped; backslashes inside are the
    text's), and is a message whatever it begins with (`/* C */`, a path); `/system` followed by BLOCK takes such a
    block as its text. A paste of several lines that the line editor takes whole (bracketed paste) is one message
    as it is. EOFError and KeyboardInterrupt at the first prompt end the chat; Ctrl-C at a continuation prompt
    drops the unfinished message (None), Ctrl-D there ends the chat."""
    line = _read_line()
    try:
        kind = "message"
        if line.startswith("/system") and line[len("/system"):].lstrip().startswith(BLOCK):
            kind, line = "system", line[len("/system"):].lstrip()
        if line.startswith(BLOCK):
            lines, line = [], line[len(BLOCK):]
            while not line.endswith(BLOCK):
                lines.append(line)
                line = _read_line(MORE)
            lines.append(line[: -len(BLOCK)])
            return "\n".join(lines).strip("\n"), kind
        lines = []
        while line.endswith("\\"):
            lines.append(line[:-1])
            line = _read_line(MORE)
        text = "\n".join([*lines, line])
        return text, "command" if text.startswith("/") else "message"
    except KeyboardInterrupt:
        err.print()
        err.print(Text("(the unfinished message was dropped)", style="dim"))
        return None


def _repl(conversation, quiet: bool, saving: _Saving) -> None:
    from llmrun.memory import memory_report

    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    err.print(Text(f"llmrun chat: {conversation.engine.loaded.files.source.spec} — /help for commands", style="dim"))
    last = None
    while True:
        try:
            message = _read_message()
        except (EOFError, KeyboardInterrupt):
            err.print()
            return
        if message is None or (not message[0].strip() and message[1] != "system"):
            continue
        line, kind = message
        if kind != "message":
            try:
                if kind == "system":
                    _set_system(conversation, line)
                elif _slash(line, conversation, last, saving):
                    return
            except LlmrunError as e:
                err.print(Text(f"error: {e}", style="bold red"))
            continue
        try:
            reply = conversation.send(line)
        except LlmrunError as e:
            err.print(Text(f"error: {e}", style="bold red"))
            continue
        interrupted = False
        try:
            stream_to_stdout(reply)
        except KeyboardInterrupt:  # the reply stops there, and is kept as a whole one is
            interrupted = True
        except LlmrunError as e:  # the reply failed part way (the model's output not finite...): the chat goes on
            if isinstance(e, OutputError):  # nothing more can be shown: keep and save the reply, then go
                _keep(conversation, reply, saving)
                raise
            conversation.take_back()
            write_out("\n")
            err.print(Text(f"error: {e}", style="bold red"))
            continue
        except BaseException:  # SIGTERM, a closed terminal, a crash: keep and save what there is, then go
            _keep(conversation, reply, saving)
            raise
        last = reply
        with signals_held():  # a Ctrl-C meant for the reply that just ended does not end the chat
            conversation.finish(reply)
            try:
                saving.after_turn(conversation)  # so that Ctrl-C, a crash or a closed terminal lose nothing
                failed = None
            except LlmrunError as e:
                failed = e
            if interrupted:
                write_out("\n")  # (the reply's own line break)
            if not quiet:
                err.print(status_line(reply.stats, memory_report(conversation.engine)))
            if failed is not None:
                err.print(Text(f"error: {failed}", style="bold red"))


def _keep(conversation, reply, saving: _Saving) -> None:
    """The reply into the conversation, and the conversation into its --save file, with no signal cutting it short."""
    with signals_held():
        conversation.finish(reply)
        saving.after_turn(conversation)


def _slash(line: str, conversation, last, saving: _Saving) -> bool:
    """Run a slash command; True means exit."""
    from llmrun.conversation import load_conversation

    command, arg = (line.split(maxsplit=1) + [""])[:2]  # at any space: /system TEXT may begin on a next line
    arg = arg.strip()
    if command in ("/exit", "/quit", "/bye"):
        return True
    if command == "/reset":
        conversation.reset()
        err.print(Text("conversation cleared", style="dim"))
    elif command == "/system":
        _set_system(conversation, arg)
    elif command == "/stats":
        _print_stats(conversation, last)
    elif command == "/save":
        path = _path(arg) if arg else saving.last
        if path is None:
            raise LlmrunError("/save needs a FILE: no file was saved or loaded yet to write to again")
        else:
            saving.claim(path)
            saving.write(conversation, path)
            saving.last = path
            saving.ours.add(path.resolve())
            err.print(Text(f"saved {_turns_text(conversation)} to {path}", style="dim"))
    elif command == "/load":
        if not arg:
            raise LlmrunError("/load needs a FILE")
        path = _path(arg)
        saved = load_conversation(path)
        every = saving.every_turn
        if every is not None and conversation.messages and path.resolve() != every.resolve():
            err.print(Text(f"note: {every} keeps the conversation before this /load until the next turn, when "
                           f"--save writes the loaded one over it", style="dim"))
        conversation.messages, conversation.system = list(saved.messages), saved.system
        conversation.template_variables = saved.template_variables
        saving.last = path
        saving.ours.add(path.resolve())
        held = "" if saved.model == saving.model else f" (saved with {saved.model}; continuing with {saving.model})"
        err.print(Text(f"loaded {_turns_text(conversation)} from {path}{held}", style="dim"))
    elif command == "/help":
        err.print(HELP)
    else:
        err.print(Text(f"unknown command {command}. {HELP}", style="yellow"))
    return False


def _set_system(conversation, text: str) -> None:
    check_utf8(text)
    conversation.system = text if text.strip() else None
    err.print(Text("system prompt " + ("set" if conversation.system else "cleared"), style="dim"))


def _path(arg: str) -> Path:
    """A slash command's FILE, which may be quoted as a shell would need it: '/save "my chat.json"'."""
    if arg[:1] in ("'", '"'):  # read as a shell reads a word; unquoted, the whole line is the name
        try:
            words = shlex.split(arg)
        except ValueError:  # a quote left open
            words = []
        if len(words) != 1:
            raise LlmrunError(f"{arg}: quote the file name as one word, as a shell would: {arg[0]}my chat.json{arg[0]}")
        arg = words[0]
    if not arg.strip():
        raise LlmrunError("the file name is empty; give one")
    return Path(arg).expanduser()


def _print_stats(conversation, last) -> None:
    from llmrun.memory import human_bytes, memory_report

    table = Table(title="llmrun stats", show_header=False)
    if last is not None:
        for key, value in last.stats.as_dict().items():
            table.add_row(key, str(value))
    for key, value in memory_report(conversation.engine).items():
        if key == "kv_compression":
            value = "-" if value is None else f"{value:.2f}x vs fp16"
        elif isinstance(value, int):  # bytes
            value = human_bytes(value)
        table.add_row(f"memory.{key}", str(value))
    table.add_row("turns", str(_turns(conversation)))
    err.print(table)
