"""The `llmrun` command line. Each command parses, calls the library, renders; torch is imported inside the
commands so `llmrun --help` stays instant."""

from __future__ import annotations

import sys

import typer

from llmrun import __version__

app = typer.Typer(
    name="llmrun",
    help="Fast local LLM inference on one machine.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool):
    if value:
        print(f"llmrun {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
):
    """Fast local LLM inference on one machine."""


from . import bench, chat, completions, eval, generate, info, models, quantize  # noqa: E402  (they register their commands on `app`)


# Typer >= 0.26 vendors click; find its exception classes where BadParameter is defined, whichever it is.
_click_errors = sys.modules[typer.BadParameter.__module__]


def main() -> None:
    """Entry point: usage errors become one `error:` line (exit 2) instead of a help panel."""
    from .options import expand_bare_options

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
    except (typer.Abort, KeyboardInterrupt):
        code = 130
    sys.exit(code if isinstance(code, int) else 0)
