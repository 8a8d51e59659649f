"""The `llmrun` executable's entry point: Ctrl-C held off imports, then the command line (`llmrun.cli.main`).

A KeyboardInterrupt raised inside a module's top-level code leaves that module half made in `sys.modules`, and
what imports it next fails otherwise: a Ctrl-C within the first second of a run (torch, numpy and the command's
modules importing) printed a traceback, a RecursionError from the half-made numpy, or was swallowed by an import
that catches everything and the run went on, or aborted the process from torch's C++ (seen here, 2026-11-28). So
this module, which imports nothing heavy, installs `hold_during_imports` before anything else is imported: a
Ctrl-C that comes while an import runs is noted and raised once no import is on the stack (looked at every 50 ms),
as if it had come then. Everywhere else Ctrl-C stays Python's KeyboardInterrupt, which the commands catch.
"""

from __future__ import annotations

import signal
import sys

RECHECK_S = 0.05  # how soon a held Ctrl-C looks again whether the import is done


def _importing(frame) -> bool:
    """Whether an import is running in frame or below it on the stack (importlib's frames are on it)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _interrupt(signum, frame):
    """SIGINT's handler, and SIGALRM's while a Ctrl-C is held."""
    if not _importing(frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGALRM, _interrupt)
    signal.setitimer(signal.ITIMER_REAL, RECHECK_S)


def hold_during_imports() -> None:
    """Make Ctrl-C wait for the import under way (where the platform has timers, and SIGINT is not ignored)."""
    if hasattr(signal, "setitimer") and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt)


def main() -> None:
    hold_during_imports()
    try:
        from llmrun.cli import main as cli_main

        cli_main()
    except KeyboardInterrupt:  # before the command line's own handling starts, or after it ends
        sys.exit(130)
