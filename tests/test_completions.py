"""Shell completion: the committed scripts are what Typer generates today, and completion works end to end through
the `llmrun` entry point (the bash script run by bash itself) without importing torch."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmrun.cli import app
from llmrun.cli.completions import FILES, completion_script

REPO = Path(__file__).resolve().parents[1]
_installed = Path(sys.executable).with_name("llmrun")
REGENERATE = "llmrun completion --write completions"


@pytest.mark.parametrize("shell", FILES)
def test_committed_scripts_are_current(shell):
    committed = REPO / "completions" / FILES[shell]
    assert committed.is_file(), f"{committed} is missing; run: {REGENERATE}"
    assert committed.read_text() == completion_script(shell), f"{committed} is stale; run: {REGENERATE}"


def test_completion_command_prints_a_script_or_writes_all_three(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["completion", "zsh"])
    assert result.exit_code == 0 and result.stdout == completion_script("zsh")
    assert result.stdout.startswith("#compdef llmrun")
    result = runner.invoke(app, ["completion", "--write", str(tmp_path)])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(FILES.values())
    assert (tmp_path / "llmrun.fish").read_text() == completion_script("fish")
    for args, message, code in ((["completion"], "error: give a SHELL", 2),
                                (["completion", "zsh", "--write", str(tmp_path)], "without a SHELL", 2),
                                (["completion", "--write", str(tmp_path / "nowhere")], "no such directory", 1)):
        result = runner.invoke(app, args)
        assert result.exit_code == code and message in result.stderr, result.stderr


@pytest.fixture(scope="module")
def llmrun_bin(tmp_path_factory) -> Path:
    """The installed `llmrun` entry point, or a stand-in calling `llmrun.entry:main` as it does."""
    if _installed.is_file():
        return _installed
    path = tmp_path_factory.mktemp("bin") / "llmrun"
    path.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import sys; sys.argv[0] = \"llmrun\"; "
                    f"from llmrun.entry import main; main()' \"$@\"\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def model_dir(tmp_path) -> Path:
    (tmp_path / "tiny.gguf").write_bytes(b"")
    return tmp_path


def _env(model_dir: Path, **extra) -> dict:
    """A hub cache holding acme/tiny-GGUF with one GGUF file (its path is all completion looks at)."""
    snapshot = model_dir / ".hub" / "models--acme--tiny-GGUF" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True, exist_ok=True)
    (snapshot / "tiny.Q4_0.gguf").write_bytes(b"")
    return {**os.environ, "HF_HUB_CACHE": str(model_dir / ".hub"), **extra}


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("words, expected", [
    ("llmrun ch", ["chat"]),
    ("llmrun mo", ["models"]),
    ("llmrun chat sm", ["smollm2"]),
    ("llmrun chat ti", ["tiny.gguf"]),
    ("llmrun info --json ti", ["tiny.gguf"]),
    ("llmrun chat --dev", ["--device"]),
    ("llmrun generate -n 4 sm", ["smollm2"]),  # [MODEL] TEXT: the first word may be a model
    ("llmrun generate smollm2 ti", []),  # ... the second is the text
    ("llmrun chat ac", ["acme/tiny-GGUF:tiny.Q4_0.gguf"]),
    # bash splits a word at ':', and replaces only what follows the colon
    ("llmrun chat acme/tiny-GGUF : ti", ["tiny.Q4_0.gguf"]),
    ("llmrun chat acme/tiny-GGUF :", ["tiny.Q4_0.gguf"]),
    ("llmrun chat --draft acme/tiny-GGUF : ti", ["tiny.Q4_0.gguf"]),
    ("llmrun chat --draft se", ["self", "self:skip"]),
    ("llmrun chat --draft self :", ["skip"]),
    ("llmrun bench --random-weights qwen2.5-1", ["qwen2.5-1.5b"]),
    ("llmrun --ins", []),  # Typer's --install-completion is not ours: `llmrun completion SHELL`
])
def test_bash_completes_through_the_committed_script(llmrun_bin, model_dir, words, expected):
    """What bash does on Tab: source completions/llmrun.bash, fill COMP_WORDS and COMP_CWORD, call the function
    (which runs `llmrun` with _LLMRUN_COMPLETE=complete_bash), read COMPREPLY."""
    script = f"""
source {REPO / 'completions' / 'llmrun.bash'}
COMP_WORDS=({words})
COMP_CWORD={len(words.split()) - 1}
_llmrun_completion {llmrun_bin}
printf '%s\\n' "${{COMPREPLY[@]}}"
"""
    result = subprocess.run(["bash", "--norc", "-c", script], capture_output=True, text=True, cwd=model_dir,
                            env=_env(model_dir), timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == expected, result.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_bash_completes_a_path_with_spaces_and_quotes_escaped(llmrun_bin, model_dir):
    """bash inserts a reply as it stands, so the reply is the path escaped as one word; and what the user typed
    escaped so far is read unescaped. What the shell then runs names the file."""
    (model_dir / "my model's.gguf").write_bytes(b"")
    (model_dir / "odd\nname.gguf").write_bytes(b"")
    for typed in ("my", "my\\ mo"):
        script = f"""
source {REPO / 'completions' / 'llmrun.bash'}
COMP_WORDS=(llmrun chat '{typed}')
COMP_CWORD=2
_llmrun_completion {llmrun_bin}
printf '%s\\n' "${{COMPREPLY[@]}}"
eval "ls ${{COMPREPLY[0]}}"
"""
        result = subprocess.run(["bash", "--norc", "-c", script], capture_output=True, text=True, cwd=model_dir,
                                env=_env(model_dir), timeout=60)
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines() == ["my\\ model\\'s.gguf", "my model's.gguf"], result.stdout
    script = f"""
source {REPO / 'completions' / 'llmrun.bash'}
COMP_WORDS=(llmrun chat od)
COMP_CWORD=2
_llmrun_completion {llmrun_bin}
eval "ls ${{COMPREPLY[0]}}"
"""
    result = subprocess.run(["bash", "--norc", "-c", script], capture_output=True, text=True, cwd=model_dir,
                            env=_env(model_dir), timeout=60)
    assert result.returncode == 0 and result.stdout == "odd\nname.gguf\n", (result.stdout, result.stderr)


def test_zsh_and_fish_protocols(llmrun_bin, model_dir):
    """The environment the zsh and fish scripts give `llmrun` (no zsh or fish needed)."""
    zsh = subprocess.run([str(llmrun_bin)], capture_output=True, text=True, cwd=model_dir, timeout=60, env=_env(
        model_dir, _LLMRUN_COMPLETE="complete_zsh", _TYPER_COMPLETE_ARGS="llmrun quantize sm"))
    assert zsh.returncode == 0 and '"smollm2":"the embedded model"' in zsh.stdout, zsh.stderr
    fish = subprocess.run([str(llmrun_bin)], capture_output=True, text=True, cwd=model_dir, timeout=60, env=_env(
        model_dir, _LLMRUN_COMPLETE="complete_fish", _TYPER_COMPLETE_FISH_ACTION="get-args",
        _TYPER_COMPLETE_ARGS="llmrun eval ti"))
    assert fish.returncode == 0 and fish.stdout.split() == ["tiny.gguf"], fish.stderr


@pytest.mark.parametrize("shell", ["zsh", "fish"])
def test_descriptions_are_one_line_each(llmrun_bin, model_dir, shell):
    """Typer renders help texts wrapped at 80 columns; fish would read each line as a candidate."""
    out = subprocess.run([str(llmrun_bin)], capture_output=True, text=True, cwd=model_dir, timeout=60, env=_env(
        model_dir, _LLMRUN_COMPLETE=f"complete_{shell}", _TYPER_COMPLETE_FISH_ACTION="get-args",
        _TYPER_COMPLETE_ARGS="llmrun bench --")).stdout
    lines = out.removeprefix("_arguments '*: :((").removesuffix("))'\n").splitlines()
    assert len(lines) > 20 and all(line.startswith(('"--', "--")) for line in lines), out
    kind = next(line for line in lines if "--kind" in line)
    assert "summarize (~390-token passage)" in kind and "  " not in kind


def test_completion_does_not_import_torch(model_dir):
    """Every Tab runs `llmrun`: it must answer from the parameters alone."""
    script = """
import os, sys
from llmrun.cli import main
sys.argv = ["llmrun"]
for words in ("llmrun ch", "llmrun chat sm", "llmrun eval ", "llmrun generate sm", "llmrun bench --random-weights llama3.2"):
    os.environ.update(_LLMRUN_COMPLETE="complete_bash", COMP_WORDS=words, COMP_CWORD=str(len(words.split()) - (not words.endswith(" "))))
    try:
        main()
    except SystemExit as e:
        assert e.code == 0, (words, e.code)
print("torch" in sys.modules, file=sys.stderr)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=model_dir,
                            env=_env(model_dir), timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr.split() == ["False"]
    assert result.stdout.split() == ["chat", "smollm2", "smollm2", "tiny.gguf", "acme/tiny-GGUF:tiny.Q4_0.gguf", "smollm2",
                                     "llama3.2-1b", "llama3.2-3b"]
