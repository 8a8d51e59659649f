"""The CLI end to end on the embedded model: in-process through Typer's CliRunner (the model loaded once for the
module), as real processes of the installed `llmrun` (pipes), and the interactive chat in a pseudo-terminal."""

import fcntl
import functools
import importlib.util
import json
import os
import pty
import re
import select
import shlex
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import llmrun
from llmrun.cli import app

_installed = Path(sys.executable).with_name("llmrun")
LLMRUN = [str(_installed)] if _installed.is_file() else [sys.executable, "-m", "llmrun"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200", "LINES": "50"}
LOAD_S = 180  # generous: loading takes ~4 s on an idle machine, much longer on a busy CI runner

PROMPT = "The capital of France is"
QUESTION = "What is the capital of France?"
GREEDY = ("--temperature", "0", "-n", "16")


def _as_in_a_terminal():
    # A shell runs background jobs with SIGINT ignored (and nohup, SIGHUP), and llmrun keeps an ignored signal
    # ignored, as Python does SIGINT: the Ctrl-C and hang-up tests need the handlers a terminal session would give.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def run(*args, input=None, timeout=LOAD_S) -> subprocess.CompletedProcess:
    """`llmrun ARGS` as a real process; stdin is `input` (or empty), stdout and stderr are captured."""
    return subprocess.run(
        [*LLMRUN, *args], input=input or "", capture_output=True, text=True, env=ENV, timeout=timeout
    )



def test_a_reader_that_goes_away_stops_the_reply_quietly():
    """`llmrun generate ... | head -c 5`: no traceback, no error line; the exit status SIGPIPE gives a C program."""
    proc = subprocess.Popen([*LLMRUN, "generate", "Once upon a time", "-n", "300", "--temperature", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    assert len(proc.stdout.read(5)) == 5
    proc.stdout.close()
    assert proc.wait(timeout=LOAD_S) == 141
    assert proc.stderr.read() == b""


def test_a_closed_stdout_is_one_error_line():
    done = subprocess.run([*LLMRUN, "chat", "-p", "Hi", "-n", "3"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, env=ENV, timeout=LOAD_S, preexec_fn=lambda: os.close(1))
    assert done.returncode == 2 and done.stderr.splitlines() == [
        "error: standard output is closed; redirect it (> FILE, or > /dev/null) instead"]

@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("args", [["--version"], ["--help"], ["chat", "--help"], ["completion", "bash"],
                                  ["models", "--json"], ["generate", "Hi", "-n", "3"],
                                  ["generate", "Hi", "-n", "3", "--json"]])
def test_a_stdout_that_refuses_writes_is_one_error_line(args):
    """`> /dev/full` (or a disk that filled up): one error line, exit 1, no traceback at the write or the exit."""
    with open("/dev/full", "w") as full:
        done = subprocess.run([*LLMRUN, *args], stdin=subprocess.DEVNULL, stdout=full, stderr=subprocess.PIPE,
                              text=True, env=ENV, timeout=LOAD_S)
    assert done.returncode == 1 and done.stderr.splitlines()[-1:] == [
        "error: cannot write to standard output (No space left on device)"], done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_chat_whose_stdout_refuses_writes_ends_and_keeps_the_turn(tmp_path):
    with open("/dev/full", "w") as full:
        done = subprocess.run([*LLMRUN, "chat", "-n", "3", "--temperature", "0", "--save", tmp_path / "c.json"],
                              input="Hi\n", stdout=full, stderr=subprocess.PIPE, text=True, env=ENV,
                              timeout=LOAD_S)
    assert done.returncode == 1 and "error: cannot write to standard output" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    messages = json.loads((tmp_path / "c.json").read_text())["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] and messages[0]["content"] == "Hi"


@pytest.fixture(scope="module")
def cli():
    """Invoke the app in-process; every command of the module shares one loaded model (each gets its own
    Engine and KV cache, as a real run does)."""
    import llmrun.loading

    runner = CliRunner()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llmrun.loading, "load_model", functools.cache(llmrun.loading.load_model))

        def invoke(*args, input=None):
            result = runner.invoke(app, list(args), input=input)
            assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
            return result

        yield invoke


def _json(result) -> dict:
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout  # one JSON object, nothing else on stdout
    return json.loads(lines[0])


def _as_printed(text: str) -> str:
    """What plain (non --json) mode writes to stdout for a reply `text`: it, ending with a newline."""
    return text if text.endswith("\n") else text + "\n"


# --- help, version, info: no model load ---------------------------------------------------------------------


def test_help_lists_the_commands(cli):
    for flag in ("--help", "-h"):
        out = cli(flag).stdout
        assert "Usage: llmrun" in out
        for command in ("chat", "generate", "info"):
            assert re.search(rf"^\W*{command}\s", out, re.M), out


def test_no_arguments_shows_help():
    result = run(timeout=60)
    assert "Usage: llmrun" in result.stdout
    assert "Traceback" not in result.stderr
    assert "error:" not in result.stderr


def test_version(cli):
    assert cli("--version").stdout == f"llmrun {llmrun.__version__}\n"
    result = run("--version", timeout=60)
    assert result.returncode == 0 and result.stdout == f"llmrun {llmrun.__version__}\n"


def test_help_is_instant_and_does_not_import_torch():
    script = """
import sys, time
t0 = time.perf_counter()
from llmrun.cli import main
for argv in ([], ["generate"], ["chat"], ["info"]):
    sys.argv = ["llmrun", *argv, "--help"]
    try:
        main()
    except SystemExit as e:
        assert e.code == 0, (argv, e.code)
    if not argv:
        top_level_s = time.perf_counter() - t0
print("torch" in sys.modules, top_level_s, file=sys.stderr)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=ENV, timeout=60)
    assert result.returncode == 0, result.stderr
    torch_imported, seconds = result.stderr.split()
    assert torch_imported == "False"
    assert float(seconds) < 1.0  # import + top-level help; typically ~0.3 s
    assert result.stdout.count("Usage: llmrun") == 4


def test_info_json(cli):
    doc = _json(cli("info", "--json"))
    assert doc["architecture"] == "LlamaForCausalLM"
    assert (doc["layers"], doc["heads"], doc["kv_heads"], doc["head_dim"]) == (30, 9, 3, 64)
    assert doc["context_length"] == 8192
    assert doc["chat_template"] is True
    assert doc["tokenizer"] == "bpe"
    assert doc["format"] == "gguf"
    per_head = {"fp32": 2 * 64 * 4, "bf16": 2 * 64 * 2, "fp16": 2 * 64 * 2, "int8": 2 * (64 + 2 * 2),
                "int4": (32 + 2 * 2 * 2) + (32 + 2 * 2 * 64 // 32)}  # codes + fp16 scales (and minimums)
    assert doc["kv_bytes_per_token"] == {fmt: 30 * 3 * n for fmt, n in per_head.items()}
    assert all(type(n) is int for n in doc["kv_bytes_per_token"].values())
    rings = 2 * 608 * 30 * 3 * 64  # K and V, slots (576 positions read exact, 32 for a rollback), layers, heads, dim
    assert doc["kv_int4_rings"] == {"positions": 576, "slots": 608, "bf16": rings * 2, "fp32": rings * 4}
    assert 130e6 < doc["parameters"] < 140e6


def test_info_table_goes_to_stderr(cli):
    result = cli("info")
    assert result.stdout == ""  # stdout is only for generated text and --json
    assert "LlamaForCausalLM" in result.stderr and "8192" in result.stderr


# --- generate ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def greedy(cli) -> dict:
    """`generate --json` of PROMPT, greedy, 16 tokens."""
    return _json(cli("generate", *GREEDY, "--json", PROMPT))


def test_generate_json(greedy):
    assert greedy["text"].strip()
    assert 0 < greedy["new_tokens"] <= 16
    assert len(greedy["token_ids"]) == greedy["new_tokens"]
    assert greedy["finish_reason"] in ("length", "stop")
    assert greedy["prompt_tokens"] > 0 and greedy["model"] == "smollm2"
    assert greedy["memory"]["weights"] > 0 and greedy["memory"]["kv_allocated"] > 0


@pytest.mark.parametrize("sig, json_out", [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGTERM, True),
                                          (signal.SIGHUP, True), (signal.SIGINT, True)])
def test_generate_cut_short_ends_its_line_or_prints_its_json(monkeypatch, capsys, greedy, sig, json_out):
    """A signal in the middle of `generate`: the text shown ends its line, as a whole reply's does (it stopped
    mid-line); with --json the partial reply's document is printed after SIGTERM or SIGHUP too (`timeout N llmrun
    ... --json` printed nothing), as after Ctrl-C."""
    from llmrun.generate import Generation

    from .conftest import run_main

    pieces = Generation.__iter__

    def cut(self):
        for n, piece in enumerate(pieces(self)):
            if n == 3:
                os.kill(os.getpid(), sig)
            yield piece

    monkeypatch.setattr(Generation, "__iter__", cut)
    # as in a terminal: a run under nohup ignores SIGHUP (main() leaves it so), a background job SIGINT
    before = signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    try:
        code, out, err = run_main(["generate", *GREEDY, *(["--json"] if json_out else []), PROMPT], monkeypatch, capsys)
    finally:
        signal.signal(sig, before)
    assert code == 128 + sig and "Traceback" not in err, err
    if json_out:
        doc = json.loads(out)
        assert doc["finish_reason"] == "interrupted" and 3 <= doc["new_tokens"] < greedy["new_tokens"]
        assert greedy["text"].startswith(doc["text"])
    else:
        assert out.endswith("\n") and not out.endswith("\n\n") and greedy["text"].startswith(out[:-1])


def test_generate_stdout_is_only_the_text_and_deterministic(cli, greedy):
    first = cli("generate", *GREEDY, PROMPT)
    second = cli("generate", *GREEDY, PROMPT)
    assert first.stdout == second.stdout == _as_printed(greedy["text"])
    assert "tok/s" in first.stderr and "tok/s" not in first.stdout  # the status line goes to stderr
    assert cli("generate", *GREEDY, "--quiet", PROMPT).stderr == ""


def test_generate_reads_stdin(cli, greedy):
    assert cli("generate", *GREEDY, "-", input=PROMPT).stdout == _as_printed(greedy["text"])
    assert cli("generate", *GREEDY, input=PROMPT).stdout == _as_printed(greedy["text"])  # no TEXT: stdin too
    assert cli("generate", *GREEDY, input="\ufeff" + PROMPT).stdout == _as_printed(greedy["text"])  # a BOM is not text


def test_generate_in_a_real_process_through_a_pipe(cli):
    """`echo TEXT | llmrun generate -`: the installed executable, a real pipe, the same text as in-process."""
    shell = subprocess.run(
        f"echo {shlex.quote(PROMPT)} | {shlex.join(LLMRUN)} generate - {shlex.join(GREEDY)}",
        shell=True, capture_output=True, text=True, env=ENV, timeout=LOAD_S,
    )
    assert shell.returncode == 0, shell.stderr
    assert shell.stdout == cli("generate", *GREEDY, "-", input=PROMPT + "\n").stdout  # echo adds the newline
    assert shell.stdout.strip()
    assert "tok/s" in shell.stderr and "Traceback" not in shell.stderr


def test_the_same_seed_gives_the_same_sample(cli):
    def sample(seed: int) -> list[int]:
        doc = _json(cli("generate", "Once upon a time", "--json", "--temperature", "1", "--top-k", "0",
                        "--top-p", "1", "--min-p", "0", "-n", "24", "--seed", str(seed)))
        return doc["token_ids"]

    first = sample(7)
    assert len(first) > 8
    assert sample(7) == first
    assert sample(8) != first


def test_stop_string_cuts_before_its_first_occurrence(cli, greedy, smollm2):
    text = greedy["text"]
    words = [w for w in re.findall(r"[A-Za-z]{3,}", text) if text.index(w) > 0]
    assert words, text
    stop = words[len(words) // 2]
    expected = text[: text.index(stop)]

    doc = _json(cli("generate", *GREEDY, "--json", "--stop", stop, PROMPT))
    assert (doc["text"], doc["finish_reason"]) == (expected, "stop")
    assert doc["new_tokens"] <= greedy["new_tokens"]
    # token_ids: the tokens generated, the stop string's among them (as the README says), greedy's first ones
    ids = doc["token_ids"]
    assert len(ids) == doc["new_tokens"] and ids == greedy["token_ids"][:len(ids)]
    assert smollm2.tokenizer.decode(ids).startswith(expected + stop)
    # Repeatable: a stop string that never shows up changes nothing.
    assert cli("generate", *GREEDY, "--stop", "zqxjv", "--stop", stop, PROMPT).stdout == _as_printed(expected)


# --- chat, one turn ----------------------------------------------------------------------------------------

CHAT = ("chat", "--temperature", "0", "-n", "24")


def test_chat_one_turn_prompt_or_stdin(cli):
    by_option = cli(*CHAT, "-p", QUESTION)
    assert by_option.stdout.strip()
    assert "tok/s" in by_option.stderr and "tok/s" not in by_option.stdout
    assert cli(*CHAT, input=QUESTION).stdout == by_option.stdout


def test_chat_question_echoed_into_stdin_is_the_same_question(cli):
    assert cli(*CHAT, input=QUESTION + "\n").stdout == cli(*CHAT, "-p", QUESTION).stdout
    assert cli(*CHAT, input="\ufeff" + QUESTION + "\n").stdout == cli(*CHAT, "-p", QUESTION).stdout  # a file's BOM


def test_chat_json(cli):
    doc = _json(cli(*CHAT, "--json", "-p", QUESTION))
    assert doc["text"].strip()
    assert 0 < doc["new_tokens"] <= 24
    assert doc["prompt_tokens"] > len(QUESTION.split())  # the chat template wraps the question
    assert doc["decode_tok_s"] > 0
    assert doc["memory"]["weights"] > 0 and doc["memory"]["kv_allocated"] > 0
    assert doc["finish_reason"] in ("length", "stop")


def test_chat_template_kwargs_reach_every_turns_template(cli, monkeypatch):
    from llmrun.tokenizer import Tokenizer

    seen, render = [], Tokenizer.render_chat
    monkeypatch.setattr(Tokenizer, "render_chat", lambda self, m, gen=True, variables=None:
                        seen.append(variables) or render(self, m, gen, variables))
    plain = _json(cli(*CHAT, "--json", "-p", QUESTION))
    given = _json(cli(*CHAT, "--json", "-p", QUESTION, "--chat-template-kwargs", '{"enable_thinking": false}'))
    assert seen == [None, {"enable_thinking": False}]
    assert given["text"] == plain["text"]  # (SmolLM2's template reads no such variable)


@pytest.mark.parametrize("value, code, message", [
    ("[1]", 2, "must be a JSON object"), ("{", 2, "is not JSON"),
    ('{"bos_token": "x", "messages": []}', 2, "sets bos_token, messages, which llmrun gives"),
    ('{"note": "\\ud800"}', 2, "holds the JSON escape \\ud800, a lone surrogate"),
    ('{"x": 1, "k": "\\udc80"}', 2, "holds the JSON escape \\udc80, a lone surrogate"),  # (not a "byte 0x80")
])
def test_chat_template_kwargs_that_cannot_be_used_are_refused_before_loading(value, code, message):
    result = run("chat", "-p", "hi", "--chat-template-kwargs", value, "/nonexistent.gguf")
    assert result.returncode == code and message in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_chat_in_a_real_process_reads_piped_stdin(cli):
    result = run(*CHAT, input=QUESTION)
    assert result.returncode == 0, result.stderr
    assert result.stdout == cli(*CHAT, "-p", QUESTION).stdout
    assert "Traceback" not in result.stderr


def _signal_one_turn(sig: int, *args: str) -> tuple[int, str, bytes]:
    """`llmrun chat -p STORY ARGS`, sent `sig` once the story has begun -> (exit code, stdout, stderr)."""
    proc = subprocess.Popen(
        [*LLMRUN, "chat", "-p", "Write a long story about a dragon.", "--temperature", "0", "-n", "400", *args],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV,
        preexec_fn=_as_in_a_terminal,
    )
    try:
        assert select.select([proc.stdout], [], [], LOAD_S)[0], "no reply before the deadline"
        begun = os.read(proc.stdout.fileno(), 4096)
        assert begun.strip()  # the story has begun
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert b"Traceback" not in err
    return proc.returncode, (begun + out).decode(), err


def test_ctrl_c_in_one_turn_mode_exits_130():
    code, out, err = _signal_one_turn(signal.SIGINT)
    assert code == 130, err
    assert b"interrupted" in err
    assert out.endswith("\n") and not out.endswith("\n\n")  # the part shown ends its line, as a whole reply does


_CTRL_C_IN_AN_IMPORT = """
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
if sys.argv[2] == "held":
    from llmrun.entry import hold_during_imports

    hold_during_imports()
try:
    import slow_module
    sys.stdout.write(f"imported {slow_module.DONE}\\n")  # one write: the held Ctrl-C may come at any bytecode after
    sys.stdout.flush()  # the import (a print's text and its newline are two writes: it once came between them)
    time.sleep(10)
    print("not interrupted", flush=True)
except KeyboardInterrupt:
    print("interrupted", "slow_module" in sys.modules, flush=True)
"""

_SLOW_MODULE = """
import os, signal, time
os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of the import, the rest of it still to run
end = time.monotonic() + 0.3
while time.monotonic() < end:  # bytecode, where Python runs signal handlers
    pass
DONE = True
"""


@pytest.mark.parametrize("held", [True, False])
def test_ctrl_c_during_an_import_is_raised_once_the_import_is_done(tmp_path, held):
    """llmrun's entry point holds a Ctrl-C that comes during an import (torch's, numpy's: a module half made
    breaks what imports it next) until the import ends, then raises it; without it, the import is cut short."""
    (tmp_path / "slow_module.py").write_text(_SLOW_MODULE)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _CTRL_C_IN_AN_IMPORT, str(tmp_path), "held" if held else "plain"],
                          capture_output=True, text=True, timeout=60, preexec_fn=_as_in_a_terminal)
    assert proc.stdout.split("\n")[:-1] == (["imported True", "interrupted True"] if held else ["interrupted False"])
    assert time.monotonic() - start < 8  # the sleep after the import was cut short


def test_sigterm_in_one_turn_mode_keeps_and_saves_the_partial_reply(tmp_path):
    saved = tmp_path / "c.json"
    code, out, err = _signal_one_turn(signal.SIGTERM, "--save", str(saved))
    assert code == 128 + signal.SIGTERM, err
    messages = json.loads(saved.read_text())["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[1]["content"] == out.strip()


# --- the interactive chat, in a pseudo-terminal ------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
PROMPT_MARK = b">>> "
_HAS_READLINE = importlib.util.find_spec("readline") is not None  # the REPL uses it when it is there


class Terminal:
    """`llmrun ARGS` with a pseudo-terminal as stdin, stdout and stderr, as a person runs it. Every wait has a
    deadline, and `close` kills the process if it is still running, so a test can never hang."""

    def __init__(self, *args, env=None):
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))  # rows, cols: no wrapping
        self.proc = subprocess.Popen(
            [*LLMRUN, *args], stdin=slave, stdout=slave, stderr=slave, env={**ENV, **(env or {})}, close_fds=True,
            start_new_session=True, preexec_fn=_as_in_a_terminal,
        )
        os.close(slave)
        self.master = master
        self.output = bytearray()
        self.mark = 0  # `expect` looks at the output after this position

    def expect(self, pattern: bytes, timeout: float = 60) -> str:
        """Read until `pattern` appears after the mark; move the mark past it; return the text up to it with
        the terminal escapes taken out."""
        deadline = time.monotonic() + timeout
        while (found := self.output.find(pattern, self.mark)) < 0:
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} within {timeout} s; output so far:\n{self.text()}"
            ready, _, _ = select.select([self.master], [], [], min(left, 0.5))
            if ready:
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:  # EIO: the process closed the terminal
                    chunk = b""
                assert chunk, f"the process ended (rc {self.proc.poll()}) before {pattern!r}:\n{self.text()}"
                self.output += chunk
        start, self.mark = self.mark, found + len(pattern)
        return _ANSI.sub("", self.output[start:found].decode(errors="replace"))

    def send(self, line: str) -> None:
        self.press(line.encode() + b"\r")

    def press(self, keys: bytes) -> None:
        """Type `keys` once the line editor reads the terminal, as a person does after seeing the prompt."""
        self._wait_for_line_editor()
        self.mark = len(self.output)
        os.write(self.master, keys)

    def _wait_for_line_editor(self, timeout: float = 10) -> None:
        # The prompt is printed before input() starts readline, which then takes the terminal out of canonical
        # mode; a Ctrl-D typed in between is lost. The master side reads the terminal's mode.
        if not _HAS_READLINE:
            return
        deadline = time.monotonic() + timeout
        while termios.tcgetattr(self.master)[3] & termios.ICANON:
            assert time.monotonic() < deadline, f"the line editor never started:\n{self.text()}"
            time.sleep(0.01)

    def stats(self) -> str:
        self.send("/stats")
        return self.expect(PROMPT_MARK)

    def wait(self, timeout: float = 30) -> int:
        """Drain the output until the process exits; its exit code."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            if select.select([self.master], [], [], 0.2)[0]:
                try:
                    self.output += os.read(self.master, 65536)
                except OSError:
                    pass
        try:
            return self.proc.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running after {timeout} s; output:\n{self.text()}")

    def text(self) -> str:
        return _ANSI.sub("", self.output.decode(errors="replace"))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


@pytest.fixture
def terminal():
    opened = []

    def start(*args, env=None) -> Terminal:
        opened.append(Terminal(*args, env=env))
        return opened[-1]

    yield start
    for t in opened:
        t.close()


def _stat(table: str, key: str) -> str:
    m = re.search(rf"{re.escape(key)}\s*[│|]\s*(\S+)", table)
    assert m, f"no {key} in:\n{table}"
    return m.group(1)


def test_repl_multi_turn_reuses_the_kv_cache_and_runs_slash_commands(terminal):
    t = terminal("chat", "--temperature", "0", "-n", "16", "--ctx", "1024")
    banner = t.expect(PROMPT_MARK, timeout=LOAD_S)
    assert "/help" in banner

    t.send(QUESTION)
    first = t.expect(PROMPT_MARK)
    assert "tok/s" in first  # the status line after the reply
    stats = t.stats()
    assert "llmrun stats" in stats
    assert _stat(stats, "turns") == "1" and _stat(stats, "memory.kv_format") == "fp32"
    assert _stat(stats, "reused_tokens") == "0"

    t.send("And what is the capital of Italy?")
    t.expect(PROMPT_MARK)
    stats = t.stats()
    assert _stat(stats, "turns") == "2"
    assert int(_stat(stats, "reused_tokens")) > 0  # the first turn's K/V stayed in the cache
    assert int(_stat(stats, "prompt_tokens")) > int(_stat(stats, "reused_tokens"))

    t.send("/reset")
    assert "conversation cleared" in t.expect(PROMPT_MARK)
    assert _stat(t.stats(), "turns") == "0"
    t.send("/system You are terse.")
    assert "system prompt set" in t.expect(PROMPT_MARK)
    t.send("/nonsense")
    assert "unknown command /nonsense" in t.expect(PROMPT_MARK)
    t.send("/exit")
    assert t.wait() == 0
    assert "Traceback" not in t.text()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_repl_sigterm_or_sighup_saves_the_reply_under_way_and_gives_the_cursor_back(terminal, tmp_path, sig):
    saved = tmp_path / "c.json"
    t = terminal("chat", "--temperature", "0", "-n", "400", "--ctx", "1024", "--save", str(saved))
    t.expect(PROMPT_MARK, timeout=LOAD_S)
    t.send("Write a long story about a dragon.")
    t.expect(b"\x1b[?25h")  # the spinner is gone: the reply is under way
    t.proc.send_signal(sig)
    assert t.wait() == 128 + sig
    assert "Traceback" not in t.text()
    assert t.output.count(b"\x1b[?25l") == t.output.count(b"\x1b[?25h")  # every hidden cursor shown again
    messages = json.loads(saved.read_text())["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] and messages[1]["content"]


def test_repl_sigterm_while_thinking_gives_the_cursor_back(terminal):
    t = terminal("chat", "--temperature", "0", "-n", "4", "--ctx", "4096")
    t.expect(PROMPT_MARK, timeout=LOAD_S)
    t.send("The quick brown fox jumps over the lazy dog. " * 150)  # a long prefill: the spinner stays a while
    t.expect(b"thinking")
    t.proc.send_signal(signal.SIGTERM)
    assert t.wait() == 128 + signal.SIGTERM
    assert "Traceback" not in t.text()
    assert t.output.count(b"\x1b[?25l") == t.output.count(b"\x1b[?25h")


def test_repl_ctrl_d_at_the_prompt_exits_0(terminal):
    t = terminal("chat", "--temperature", "0", "-n", "16", "--ctx", "256")
    t.expect(PROMPT_MARK, timeout=LOAD_S)
    t.press(b"\x04")
    assert t.wait() == 0
    assert "Traceback" not in t.text()


def test_repl_ctrl_c_stops_the_reply_and_keeps_the_conversation(terminal):
    t = terminal("chat", "--temperature", "0", "-n", "400", "--ctx", "1024")
    t.expect(PROMPT_MARK, timeout=LOAD_S)
    t.send("Write a long story about a dragon.")
    # Rich shows the cursor again when the "thinking" spinner stops, which it does once the first piece of
    # the reply has arrived: from here on the reply is under way.
    t.expect(b"\x1b[?25h")
    t.proc.send_signal(signal.SIGINT)
    t.expect(PROMPT_MARK, timeout=30)
    assert t.proc.poll() is None  # still running: Ctrl-C stopped the reply, not the chat

    stats = t.stats()
    assert _stat(stats, "turns") == "1"  # the partial reply is kept as the answer
    assert _stat(stats, "finish_reason") == "interrupted"
    assert int(_stat(stats, "new_tokens")) < 400
    t.send("/exit")
    assert t.wait() == 0
    assert "Traceback" not in t.text()



def test_repl_prompt_without_colour_where_asked(terminal):
    """NO_COLOR (or TERM=dumb) leaves the prompt uncoloured, as Rich leaves the rest (its dim and bold stay)."""
    t = terminal("chat", "--ctx", "256", env={"NO_COLOR": "1"})
    t.expect(PROMPT_MARK, timeout=LOAD_S)
    assert t.output.endswith(b"\r\n>>> ") and b"\x1b[1;32m" not in t.output
    t.send("/exit")
    assert t.wait() == 0

def test_repl_messages_of_several_lines(terminal, tmp_path):
    """A line ending in a backslash goes on at the next; three double quotes open and close a block of lines;
    Ctrl-C at a continuation prompt drops the unfinished message and the chat goes on; /system takes its text
    from the lines after it too, and from a block; a block is a message even where it begins with a slash. The
    saved conversation shows each message as it was meant."""
    saved = tmp_path / "c.json"
    t = terminal("chat", "--temperature", "0", "-n", "4", "--ctx", "1024", "--save", str(saved))
    t.expect(PROMPT_MARK, timeout=LOAD_S)
    t.send("/system You are\\")
    t.expect(b"... ")
    t.send("terse.")
    assert "system prompt set" in t.expect(PROMPT_MARK)
    t.send("Name a colour,\\")
    t.expect(b"... ")
    t.send("then a fruit.")
    assert "tok/s" in t.expect(PROMPT_MARK)  # one reply, to the two lines
    assert json.loads(saved.read_text())["system"] == "You are\nterse."  # (--save writes after every turn)
    t.send('"""')  # alone on its line: the message begins at the next
    t.expect(b"... ")
    t.send("def f(x):")
    t.expect(b"... ")
    t.send("    return x + 1  \\")  # inside the block a backslash is the text's
    t.expect(b"... ")
    t.send("")
    t.expect(b"... ")
    t.send('What does f do?"""')
    assert "tok/s" in t.expect(PROMPT_MARK)
    t.send('"""/* C: a block is a message whatever it begins with */')
    t.expect(b"... ")
    t.send('int add(int a, int b);"""')
    assert "tok/s" in t.expect(PROMPT_MARK)
    t.send('/system """  Be')  # /system takes a block too, as it is
    t.expect(b"... ")
    t.send('brief."""')
    assert "system prompt set" in t.expect(PROMPT_MARK)
    t.send('"""')
    t.expect(b"... ")
    t.send("never sent")
    t.expect(b"... ")
    t._wait_for_line_editor()
    # as a person presses it, not within the moment the prompt appears: a SIGINT then can wait for the next key
    # (GNU readline's handlers, installed while it handles a key, hold it until its next one)
    time.sleep(1)
    t.proc.send_signal(signal.SIGINT)
    assert "unfinished message was dropped" in t.expect(PROMPT_MARK)
    assert t.proc.poll() is None
    t.send("/save")  # the system prompt set after the last turn
    assert "saved 3 turns" in t.expect(PROMPT_MARK)
    t.send("/exit")
    assert t.wait() == 0
    assert "Traceback" not in t.text()
    doc = json.loads(saved.read_text())
    assert doc["system"] == "  Be\nbrief."
    assert [m["content"] for m in doc["messages"] if m["role"] == "user"] == [
        "Name a colour,\nthen a fruit.", "def f(x):\n    return x + 1  \\\n\nWhat does f do?",
        "/* C: a block is a message whatever it begins with */\nint add(int a, int b);"]
