"""`llmrun models` and the MODEL completion: the embedded alias, a fake Hugging Face hub cache, local files, and
the index of checkpoints `llmrun quantize` wrote. No model is loaded."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import llmrun.catalog as catalog
from llmrun.cli import app

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _hub_repo(hub: Path, repo_id: str, files: dict[str, int]) -> Path:
    """A repository as huggingface_hub caches it: blobs, a snapshot of links to them, refs/main."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    for i, (name, size) in enumerate(files.items()):
        blob = repo / "blobs" / f"{i:040x}"
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(b"\0" * size)
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).symlink_to(blob)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """A fake hub cache: a safetensors model, a GGUF repository, a download that never finished, a dataset."""
    hub = tmp_path / "hub"
    _hub_repo(hub, "acme/tiny-llama", {"config.json": 100, "model.safetensors": 5000, "tokenizer.json": 900})
    _hub_repo(hub, "acme/tiny-GGUF", {"tiny.Q4_0.gguf": 3000, "sub/tiny.Q8_0.gguf": 6000, "README.md": 10})
    (hub / "models--acme--empty" / "snapshots").mkdir(parents=True)
    (hub / "datasets--acme--text" / "snapshots" / COMMIT).mkdir(parents=True)
    gone = _hub_repo(hub, "acme/gone-GGUF", {"gone.gguf": 10})  # its blob deleted by hand: a dangling link
    (gone / "gone.gguf").resolve().unlink()
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    return hub


@pytest.fixture
def index(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache" / "quantized.json"
    monkeypatch.setattr(catalog, "quantized_index_path", lambda: path)
    return path


def _quantized_dir(path: Path, method="awq", bits=4, group=64) -> Path:
    """What `llmrun quantize` leaves, as far as `llmrun models` reads it."""
    path.mkdir(parents=True)
    quant = {"quant_method": "gptq" if method == "int8" else "awq", "bits": bits, "group_size": group}
    config = {"architectures": ["LlamaForCausalLM"], "quantization_config": quant,
              "llmrun": {"quantized_from": "smollm2", "method": method}}
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"\0" * 4096)
    return path


def _values(completions) -> list[str]:
    return [c[0] if isinstance(c, tuple) else c for c in completions]


# --- where things are ------------------------------------------------------------------------------------------


def test_cache_dirs_follow_the_environment(tmp_path, monkeypatch):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert catalog.cache_dir() == tmp_path / ".cache" / "llmrun"
    assert catalog.hub_cache_dir() == tmp_path / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert catalog.cache_dir() == tmp_path / "xdg" / "llmrun"
    assert catalog.hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert catalog.hub_cache_dir() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hubcache"))
    assert catalog.hub_cache_dir() == tmp_path / "hubcache"


def test_hub_entries_are_model_specs_with_their_sizes(hub):
    entries = {e.model: e for e in catalog.hub_entries()}
    assert list(entries) == ["acme/tiny-GGUF:sub/tiny.Q8_0.gguf", "acme/tiny-GGUF:tiny.Q4_0.gguf", "acme/tiny-llama"]
    assert entries["acme/tiny-llama"].bytes == 100 + 5000 + 900
    assert entries["acme/tiny-GGUF:tiny.Q4_0.gguf"].bytes == 3000
    assert entries["acme/tiny-GGUF:sub/tiny.Q8_0.gguf"].bytes == 6000
    assert {e.kind for e in entries.values()} == {"hub"}


def test_no_hub_cache_is_no_hub_models(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "nothing-here"))
    assert catalog.hub_entries() == []


def test_quantized_index_keeps_what_exists_and_drops_what_vanished(tmp_path, index):
    int4 = _quantized_dir(tmp_path / "q4")
    int8 = _quantized_dir(tmp_path / "q8", "int8", 8, -1)
    gone = _quantized_dir(tmp_path / "gone")
    for path in (int4, int8, gone, int4):  # recorded twice: listed once
        catalog.record_quantized(path)
    assert json.loads(index.read_text()) == [str(int4), str(int8), str(gone)]
    for f in gone.iterdir():
        f.unlink()
    gone.rmdir()

    entries = catalog.quantized_entries()
    assert [e.model for e in entries] == [str(int4), str(int8)]
    assert entries[0].details == {"method": "awq", "bits": 4, "group_size": 64, "quantized_from": "smollm2"}
    assert entries[1].details["method"] == "int8" and entries[1].details["group_size"] == -1
    assert entries[0].bytes == 4096 + len((int4 / "config.json").read_bytes())
    assert json.loads(index.read_text()) == [str(int4), str(int8)]  # the vanished one is forgotten


@pytest.mark.parametrize("config", ['[1, 2]', '{"quantization_config": 4, "llmrun": "awq"}'])
def test_a_config_that_is_not_an_object_lists_without_details(tmp_path, index, config):
    path = _quantized_dir(tmp_path / "q")
    (path / "config.json").write_text(config)
    catalog.record_quantized(path)
    [entry] = catalog.quantized_entries()
    assert entry.model == str(path)
    assert entry.details == {"method": None, "bits": None, "group_size": None, "quantized_from": None}


def test_a_damaged_index_is_an_empty_one(index):
    index.parent.mkdir(parents=True)
    index.write_text("{not json")
    assert catalog.quantized_entries() == []
    index.write_text('{"a": 1}')
    assert catalog.quantized_entries() == []


@pytest.fixture
def fake_quantize(monkeypatch):
    """`llmrun quantize` without the work: the checkpoint directory appears, as the real one leaves it."""
    import llmrun.quantize

    def quantize(source, out, options, device="auto", on_progress=None):
        _quantized_dir(Path(out), options.method, 4, 64)
        return llmrun.quantize.QuantizeResult(str(out), options.method, 4, 64, 0.1, 0)

    monkeypatch.setattr(llmrun.quantize, "quantize", quantize)


def test_quantize_records_what_it_wrote(tmp_path, index, fake_quantize):
    result = CliRunner().invoke(app, ["quantize", "--rtn", "-o", str(tmp_path / "q")])
    assert result.exit_code == 0, result.stderr
    assert json.loads(index.read_text()) == [str(tmp_path / "q")]
    assert [e.model for e in catalog.quantized_entries()] == [str(tmp_path / "q")]


def test_quantize_with_an_unwritable_index_warns_and_succeeds(tmp_path, monkeypatch, fake_quantize):
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setattr(catalog, "quantized_index_path", lambda: tmp_path / "not-a-dir" / "quantized.json")
    result = CliRunner().invoke(app, ["quantize", "--rtn", "-o", str(tmp_path / "q")])
    assert result.exit_code == 0, result.stderr
    assert "warning: " in result.stderr and "is not listed by `llmrun models`" in result.stderr
    assert (tmp_path / "q" / "config.json").is_file()


# --- llmrun models ---------------------------------------------------------------------------------------------


def test_models_json_lists_the_embedded_hub_and_quantized_models(tmp_path, hub, index, embedded_path):
    q = _quantized_dir(tmp_path / "smol-awq")
    catalog.record_quantized(q)
    result = CliRunner().invoke(app, ["models", "--json"])
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1  # one JSON object, nothing else on stdout
    models = {m["model"]: m for m in json.loads(lines[0])["models"]}
    assert models["smollm2"] == {"model": "smollm2", "kind": "embedded", "path": str(embedded_path),
                                 "bytes": embedded_path.stat().st_size, "details": {}}
    assert models["acme/tiny-llama"]["kind"] == "hub" and models["acme/tiny-llama"]["bytes"] == 6000
    assert "acme/tiny-GGUF:tiny.Q4_0.gguf" in models
    assert models[str(q)]["kind"] == "quantized"
    assert models[str(q)]["details"]["method"] == "awq"


def test_models_table_goes_to_stderr(tmp_path, hub, index, embedded_path, monkeypatch):
    from llmrun.cli.console import err
    from llmrun.memory import human_bytes

    monkeypatch.setattr(err, "width", 250)  # the stderr console is made once per process: COLUMNS may come late

    catalog.record_quantized(_quantized_dir(tmp_path / "smol-int8", "int8", 8, -1))
    catalog.record_quantized(_quantized_dir(tmp_path / "smol-rtn", "rtn", 4, 128))
    odd = _quantized_dir(tmp_path / "smol-odd")
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "quantization_config": ["awq"], "llmrun": None}))
    catalog.record_quantized(odd)  # a hand-edited config: listed for what it says
    result = CliRunner(env={"COLUMNS": "250"}).invoke(app, ["models"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == ""  # stdout is only for generated text and --json
    assert "quantized (config.json does not say how)" in result.stderr and "None" not in result.stderr
    assert "smollm2" in result.stderr and human_bytes(embedded_path.stat().st_size) in result.stderr
    assert "acme/tiny-llama" in result.stderr
    assert "INT8, per channel of smollm2" in result.stderr
    assert "RTN INT4, group 128 of smollm2" in result.stderr


def test_models_says_where_it_looked_for_hub_models(tmp_path, monkeypatch, index):
    from llmrun.cli.console import err

    monkeypatch.setattr(err, "width", 250)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["models"])
    assert result.exit_code == 0
    assert f"no hub models cached in {tmp_path / 'empty'}" in result.stderr


# --- completion of MODEL ---------------------------------------------------------------------------------------


@pytest.fixture
def files(tmp_path, monkeypatch) -> Path:
    """A working directory with models and other things in it."""
    work = tmp_path / "work"
    (work / "hf-model").mkdir(parents=True)
    (work / "hf-model" / "config.json").write_text("{}")
    (work / "models" / "deeper").mkdir(parents=True)
    (work / "models" / "qwen.gguf").write_bytes(b"")
    (work / ".hidden").mkdir()
    (work / "llama.gguf").write_bytes(b"")
    (work / "notes.txt").write_text("")
    monkeypatch.chdir(work)
    return work


def test_complete_model_offers_the_alias_local_models_and_hub_models(files, hub):
    offered = catalog.complete_model("")
    assert offered[0] == ("smollm2", "the embedded model")
    assert _values(offered) == ["smollm2", "hf-model", "llama.gguf", "models/", "acme/tiny-GGUF:sub/tiny.Q8_0.gguf",
                                "acme/tiny-GGUF:tiny.Q4_0.gguf", "acme/tiny-llama"]
    assert ("acme/tiny-llama", "cached hub model") in offered


@pytest.mark.parametrize("typed, expected", [
    ("sm", ["smollm2"]),
    ("l", ["llama.gguf"]),
    ("h", ["hf-model"]),  # a directory with config.json is a model: no slash, nothing to descend into
    ("m", ["models/deeper/", "models/qwen.gguf"]),  # the one plain directory matching: what is inside it
    ("models/", ["models/deeper/", "models/qwen.gguf"]),
    ("models/q", ["models/qwen.gguf"]),
    (".h", [".hidden/"]),  # hidden entries only when asked for
    ("notes", []),  # neither a GGUF file nor a directory
    ("nowhere/x", []),
    ("acme/tiny-l", ["acme/tiny-llama"]),
    ("acme/tiny-GGUF:t", ["acme/tiny-GGUF:tiny.Q4_0.gguf"]),
])
def test_complete_model_by_prefix(files, hub, typed, expected):
    assert _values(catalog.complete_model(typed)) == expected


def test_complete_model_keeps_the_path_as_typed(files, hub, monkeypatch):
    assert _values(catalog.complete_model(str(files / "ll"))) == [str(files / "llama.gguf")]
    monkeypatch.setenv("HOME", str(files))
    assert _values(catalog.complete_model("~/ll")) == ["~/llama.gguf"]
