"""Progress on long waits: a transient Rich bar on a terminal; when stderr is a pipe or a file, nothing for a short
wait and a line every 30 s for a long one;
huggingface_hub's download bars likewise; `llmrun bench` counts its measurement points."""

import io
import os
import re

import pytest
from rich.console import Console
from typer.testing import CliRunner

from llmrun.cli import app, console

from .tiny import CONFIGS, random_model, write_gguf

FAST = ["--prompt-tokens", "8", "--new-tokens", "3", "--repeat", "1", "--no-warmup", "--threads", "1"]
HF_BARS = "HF_HUB_DISABLE_PROGRESS_BARS"


@pytest.fixture(autouse=True)
def hub_bars_env(monkeypatch):
    """Whatever the commands set in HF_HUB_DISABLE_PROGRESS_BARS is undone after each test."""
    monkeypatch.setenv(HF_BARS, "")
    monkeypatch.delenv(HF_BARS)  # recorded as unset: restored so


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("progress") / "tiny.gguf", random_model(CONFIGS["llama"]))


def _drawn(monkeypatch, terminal: bool) -> str:
    """What a progress bar writes to stderr, a terminal or not."""
    screen = io.StringIO()
    monkeypatch.setattr(console, "err", Console(file=screen, force_terminal=terminal, width=120))
    with console.progress_bar("loading tiny") as update:
        update(0, 4)
        update(3, 4, "layers.1.attn.q.weight")
    return screen.getvalue()


def test_the_bar_draws_on_a_terminal_and_vanishes(monkeypatch):
    drawn = _drawn(monkeypatch, terminal=True)
    assert "loading tiny" in drawn and "3/4" in drawn and "layers.1.attn.q.weight" in drawn
    assert drawn.endswith("\x1b[1A\x1b[2K")  # transient: the last thing drawn erases the bar's line


def test_no_bar_when_stderr_is_not_a_terminal(monkeypatch):
    assert _drawn(monkeypatch, terminal=False) == ""


def test_a_long_wait_reports_on_a_line_when_stderr_is_not_a_terminal(monkeypatch):
    """A log gets a line every LOG_EVERY_S seconds of a wait (here 0: every update), never a bar."""
    monkeypatch.setattr(console, "LOG_EVERY_S", 0.0)
    assert _drawn(monkeypatch, terminal=False).splitlines() == [
        "loading tiny: 0/4 after 0 s", "loading tiny: 3/4 after 0 s (layers.1.attn.q.weight)"]


def test_a_long_wait_without_updates_still_reports(monkeypatch):
    """A log gets its lines while nothing updates the count (`llmrun bench`'s timed run updates at its end alone:
    a 73 s run wrote one line, at its end); none once the wait is over."""
    import time

    screen = io.StringIO()
    monkeypatch.setattr(console, "err", Console(file=screen, force_terminal=False, width=120))
    monkeypatch.setattr(console, "LOG_EVERY_S", 0.05)
    with console.progress_bar("bench tiny") as update:
        update(0, 1)
        time.sleep(0.4)
    lines = screen.getvalue().splitlines()
    time.sleep(0.2)
    assert len(lines) >= 2 and all(re.fullmatch(r"bench tiny: 0/1 after \d+ s", line) for line in lines), lines
    assert screen.getvalue().splitlines() == lines


def test_hub_bars_only_for_a_person_watching(monkeypatch):
    import huggingface_hub.utils

    turned_off = []
    monkeypatch.setattr(huggingface_hub.utils, "disable_progress_bars", lambda: turned_off.append(True))
    console.hub_bars(watched=True)
    assert HF_BARS not in os.environ and not turned_off
    console.hub_bars(watched=False)  # huggingface_hub reads the variable on import; imported, its switch
    assert os.environ[HF_BARS] == "1" and turned_off == [True]

    turned_off.clear()
    monkeypatch.setenv(HF_BARS, "0")  # the user's choice wins
    console.hub_bars(watched=False)
    assert os.environ[HF_BARS] == "0" and not turned_off


def test_hub_downloads_draw_as_our_bar(monkeypatch):
    """huggingface_hub counts the bytes in a tqdm of the class we give it; each such tqdm is one bar of ours."""
    from contextlib import contextmanager

    calls = []

    @contextmanager
    def bar(description):
        calls.append(("open", description))
        yield lambda done, total, what="": calls.append((done, total, what))
        calls.append(("closed",))

    monkeypatch.setattr(console, "progress_bar", bar)
    download = console.rich_tqdm()(total=2048, unit="B", desc="model.safetensors")
    download.update(1024)
    download.update(1024)
    download.close()
    download.close()  # tqdm closes again when collected: the bar closes once
    assert calls == [("open", "downloading model.safetensors"), (0, 2048, ""), (1024, 2048, "1.0 KiB of 2.0 KiB"),
                     (2048, 2048, "2.0 KiB of 2.0 KiB"), ("closed",)]


def test_a_hub_id_is_resolved_with_our_bars_on_a_terminal(monkeypatch):
    import llmrun.loading

    seen = {}
    monkeypatch.setattr(llmrun.loading, "_resolve_hub", lambda spec, bars: seen.setdefault(spec, bars))
    monkeypatch.setattr(console, "err", Console(file=io.StringIO(), force_terminal=True))  # a person watching
    monkeypatch.delenv(HF_BARS, raising=False)
    console.model_source("acme/tiny-llama")
    assert issubclass(seen["acme/tiny-llama"]["tqdm_class"], __import__("tqdm").tqdm)
    monkeypatch.setenv(HF_BARS, "1")  # the user turned download bars off: none of ours either
    console.model_source("acme/quiet")
    assert seen["acme/quiet"] == {}
    monkeypatch.setattr(console, "err", Console(file=io.StringIO(), force_terminal=False))
    monkeypatch.setenv(HF_BARS, "1")  # hub_bars must not touch the real environment here
    console.model_source("acme/other")
    assert seen["acme/other"] == {}


@pytest.mark.parametrize("command", [["info"], ["generate", "-n", "2", "--temperature", "0", "--threads", "1", "ab"],
                                     ["bench", *FAST]])
def test_commands_draw_nothing_when_stderr_is_not_a_terminal(tiny_gguf, command):
    result = CliRunner().invoke(app, [command[0], str(tiny_gguf), *command[1:]])
    assert result.exit_code == 0, (result.stderr, result.exception)
    # a spinner or bar would hide the cursor, redraw with \r and escape codes, and name what it waits for
    for mark in ("\x1b", "\r", "loading", "reading", "measuring"):
        assert mark not in result.stderr, (mark, result.stderr)
    assert os.environ[HF_BARS] == "1"  # and huggingface_hub's bars are off


def test_bench_counts_its_measurement_points(tiny_gguf):
    from llmrun import bench
    from llmrun.loading import open_model
    from llmrun.workloads import make_workload

    files = open_model(str(tiny_gguf))
    settings = bench.resolve(bench.Settings("cpu", "fp32", "auto", 1, 64), default_ctx=64)
    workload = make_workload(files.tokenizer, prompt_tokens=8, new_tokens=3, repeat=1, warmup=False)
    calls = []
    bench.benchmark(files, settings, workload, model="tiny", sweep_axes={"dtype": ("bf16",), "weights": ("dequant",)},
                    progress=lambda *call: calls.append(call))
    # the configured run, the fp32 reference (not in the grid), the grid's one configuration; then done
    assert [(done, total) for done, total, _ in calls] == [(0, 3), (1, 3), (2, 3), (3, 3)]
    assert "quality reference" in calls[1][2] and "--dtype bf16 --weights dequant" in calls[2][2]
