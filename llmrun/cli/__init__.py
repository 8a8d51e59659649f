"""The `llmrun` command line. Each command parses, calls the library, renders; torch is imported inside the
commands so `llmrun --help` stays instant."""

from __future__ import annotations

import errno
import signal
import sys

import typer

from llmrun import __version__
from llmrun.errors import LlmrunError

app = typer.Typer(
    name="llmrun",
    help="Fast local LLM inference on one machine.",
    no_args_is_help=True,
    add_completion=False,  # `llmrun completion SHELL` instead; `completions.install_responders` answers the scripts
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool):
    if value:
        from .console import write_out

        write_out(f"llmrun {__version__}\n")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
):
    """Fast local LLM inference on one machine."""


from . import bench, chat, completions, eval, generate, info, models, quantize  # noqa: E402  (they register their commands on `app`)

completions.install_responders()
from .console import Terminated  # noqa: E402


# Typer >= 0.26 vendors click; find its exception classes where BadParameter is defined, whichever it is.
_click_errors = sys.modules[typer.BadParameter.__module__]


# what a write to stdout fails with where the fault is stdout's: a disk full or failing
_WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO}


def _terminate(signum, frame):
    raise Terminated(signum)


def main() -> None:
    """Entry point: usage errors become one `error:` line (exit 2) instead of a help panel."""
    from .options import expand_bare_options

    if sys.stdout is None:  # started with stdout closed (`>&-`): replies, tables and JSON would go nowhere
        print("error: standard output is closed; redirect it (> FILE, or > /dev/null) instead", file=sys.stderr)
        sys.exit(2)
    replaced = {}
    for name in ("SIGTERM", "SIGHUP"):
        number = getattr(signal, name, None)  # (no SIGHUP on Windows)
        if number is not None and signal.getsignal(number) is signal.SIG_DFL:  # an ignored one (nohup) stays so
            replaced[number] = signal.signal(number, _terminate)
    try:
        code = app(args=expand_bare_options(sys.argv[1:]), prog_name="llmrun", standalone_mode=False)
    except _click_errors.NoArgsIsHelpError:
        code = 0  # bare `llmrun`: the help was the answer
    except _click_errors.UsageError as e:
        hint = f" (see: {e.ctx.command_path} --help)" if e.ctx else ""
        print(f"error: {e.format_message()}{hint}", file=sys.stderr)
        code = 2
    except _click_errors.ClickException as e:
        print(f"error: {e.format_message()}", file=sys.stderr)
        code = e.exit_code
    except LlmrunError as e:  # raised outside a command (`--version` into a full disk)
        print(f"error: {e}", file=sys.stderr)
        code = 1
    except OSError as e:  # the help, written before any command runs, into a full disk (a pipe gone away: click)
        if e.filename is not None or e.errno not in _WRITE_ERRORS:
            raise
        from .console import silence_stdout

        silence_stdout()
        print(f"error: cannot write to standard output ({e.strerror})", file=sys.stderr)
        code = 1
    except (typer.Abort, KeyboardInterrupt):
        code = 130
    except Terminated as e:
        code = 128 + e.signum
    finally:
        for number, handler in replaced.items():  # (for a caller that goes on: the tests)
            signal.signal(number, handler)
    sys.exit(code if isinstance(code, int) else 0)
