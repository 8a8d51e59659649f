"""`llmrun completion SHELL`: the shell completion script, made by Typer's completion machinery.

The scripts call `llmrun` back with `_LLMRUN_COMPLETE` set; Typer answers from the commands' parameters (and the
MODEL argument's `autocompletion`, `llmrun.catalog.complete_model`) before any command runs, so torch is never
imported on that path. `llmrun completion --write completions` rewrites the repository's copies.
"""

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmrun.errors import LlmrunError, UsageError

from . import app
from .console import err, user_errors

PROG = "llmrun"
COMPLETE_VAR = "_LLMRUN_COMPLETE"  # Typer's name for it: _{PROG}_COMPLETE, upper case
FILES = {"bash": "llmrun.bash", "zsh": "_llmrun", "fish": "llmrun.fish"}  # the names each shell looks for


class Shell(str, Enum):
    bash = "bash"
    zsh = "zsh"
    fish = "fish"


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
        sys.stdout.write(completion_script(shell.value))
        return
    if not write.is_dir():
        raise LlmrunError(f"--write {write}: no such directory")
    try:
        for path in write_scripts(write):
            err.print(f"wrote {path}")
    except OSError as e:
        raise LlmrunError(f"--write {write}: {e.strerror or e}") from e
