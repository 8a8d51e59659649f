"""`llmrun completion SHELL`: the shell completion script, made by Typer's completion machinery.

The scripts call `llmrun` back with `_LLMRUN_COMPLETE` set; Typer answers from the commands' parameters (and the
options' `autocompletion`, e.g. MODEL's `llmrun.catalog.complete_model`) before any command runs, so torch is
never imported on that path; the responders below mend Typer's for bash's colons and multi-line descriptions.
`llmrun completion --write completions` rewrites the repository's copies.
"""

import os
import re
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer import _completion_classes as typer_classes

from llmrun.errors import LlmrunError, UsageError

from . import app
from .console import err, user_errors, write_out

PROG = "llmrun"
COMPLETE_VAR = "_LLMRUN_COMPLETE"  # Typer's name for it: _{PROG}_COMPLETE, upper case
FILES = {"bash": "llmrun.bash", "zsh": "_llmrun", "fish": "llmrun.fish"}  # the names each shell looks for


class Shell(str, Enum):
    bash = "bash"
    zsh = "zsh"
    fish = "fish"


def install_responders() -> None:
    """Register the responders below for the scripts' callbacks, in place of Typer's own (and of its
    --install-completion and --show-completion, which the `completion` command replaces: the app has
    add_completion=False)."""
    typer_classes.completion_init()
    for cls in (BashResponder, ZshResponder, FishResponder):
        typer_classes.add_completion_class(cls, cls.name)


class BashResponder(typer_classes.BashComplete):
    """bash splits words at ':' (COMP_WORDBREAKS), so `org/name:FILE.gguf` arrives as `org/name`, `:`, `FILE`:
    join them back, and answer with what follows the word's last colon, the part bash replaces."""

    colon_prefix = ""

    def get_completion_args(self) -> tuple[list[str], str]:
        words = typer_classes.click_split_arg_string(os.environ["COMP_WORDS"])
        cword = int(os.environ["COMP_CWORD"])
        joined: list[str] = []
        for i, word in enumerate(words[: cword + 1]):
            if i > 1 and (word == ":" or joined[-1].endswith(":")):
                joined[-1] += word
            else:
                joined.append(word)
        if cword >= len(words):  # the cursor after a space: an empty word, which the split drops
            joined.append("")
        incomplete = joined[-1]
        self.colon_prefix = incomplete[: incomplete.rfind(":") + 1]
        return joined[1:-1], incomplete

    def format_completion(self, item) -> str:
        return _bash_escaped(item.value.removeprefix(self.colon_prefix))


def _bash_escaped(value: str) -> str:
    """`value` as it must stand on a bash command line: bash inserts a reply as it is, so `my model.gguf` would
    become two words. A leading `~` stays bare for bash to expand; a newline, which would end the reply, is
    written `$'\\n'`."""
    head = "~" if value.startswith("~") else ""
    escaped = re.sub(r"([^\w./:@%+,=~\n-])", r"\\\1", value.removeprefix(head))
    return head + escaped.replace("\n", "$'\\n'")


class ZshResponder(typer_classes.ZshComplete):
    """A description on one line: Typer renders help texts wrapped at 80 columns."""

    def format_completion(self, item) -> str:
        value, sep, description = super().format_completion(item).partition('":"')  # (a value's colons are escaped)
        return value + sep + _one_line(description)


class FishResponder(typer_classes.FishComplete):
    """A description on one line: fish reads every line as a candidate."""

    def format_completion(self, item) -> str:
        value, tab, description = super().format_completion(item).partition("\t")
        return value + tab + _one_line(description)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def completion_script(shell: str) -> str:
    from typer._completion_shared import get_completion_script

    return get_completion_script(prog_name=PROG, complete_var=COMPLETE_VAR, shell=shell) + "\n"


def write_scripts(folder: Path) -> list[Path]:
    """All three scripts into `folder`, each under the name its shell looks for."""
    written = []
    for shell, name in FILES.items():
        (folder / name).write_text(completion_script(shell))
        written.append(folder / name)
    return written


@app.command()
@user_errors
def completion(
    shell: Annotated[Optional[Shell], typer.Argument(show_default=False)] = None,
    write: Annotated[Optional[Path], typer.Option(metavar="DIR", file_okay=False, help=f"Write the three scripts into DIR instead ({', '.join(FILES.values())}).", show_default=False)] = None,
):
    """Print the shell completion script for SHELL (bash, zsh or fish); the README says where each goes."""
    if shell is None and write is None:
        raise UsageError("give a SHELL (bash, zsh, fish) to print its script, or --write DIR for all three")
    if shell is not None and write is not None:
        raise UsageError(f"--write {write} writes all three scripts; give it without a SHELL, or SHELL alone to print one")
    if shell is not None:
        write_out(completion_script(shell.value))
        return
    if not write.is_dir():
        raise LlmrunError(f"--write {write}: no such directory")
    try:
        for path in write_scripts(write):
            err.print(f"wrote {path}")
    except OSError as e:
        raise LlmrunError(f"--write {write}: {e.strerror or e}") from e
