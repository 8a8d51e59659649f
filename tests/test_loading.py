"""Loading: HF directories, GGUF files (with llama.cpp's Q/K permutation), hub ids from the local cache,
block dequantization, and config validation."""

import json
import math
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

from llmrun.errors import ModelFormatError, ModelNotFoundError, UnsupportedModelError
from llmrun.loading import load_model, open_model, resolve, round_to_int4
from llmrun.models import config_from_gguf, config_from_hf, config_to_hf

from .conftest import run_main
from .tiny import CONFIGS, decode_in_steps, hf_config_json, random_model, write_gguf, write_hf_dir


def _reads_back(model, source):
    """`source` (an HF directory or GGUF written from `model`) loads with the model's config and logits."""
    loaded = load_model(str(source), device="cpu", dtype="fp32")
    assert loaded.config == replace(model.config, norm_eps=loaded.config.norm_eps)  # (GGUF stores eps as float32)
    _same_logits(model, loaded)
    return loaded


def _same_logits(model, loaded):
    tokens = torch.randint(0, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(tokens), model(tokens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_hf_directory_round_trip(tmp_path, arch):
    model = random_model(CONFIGS[arch])
    path = write_hf_dir(tmp_path / arch, model)
    loaded = load_model(str(path), device="cpu", dtype="fp32")
    assert loaded.config == model.config
    _same_logits(model, loaded)


@pytest.mark.parametrize("arch", ["llama", "smollm2", "qwen2"])
def test_gguf_round_trip_undoes_rope_permutation(tmp_path, arch):
    model = random_model(CONFIGS[arch])
    gguf_arch = "qwen2" if arch == "qwen2" else "llama"  # llama.cpp permutes Q/K rows only for llama
    path = write_gguf(tmp_path / f"{arch}.gguf", model, gguf_arch)
    loaded = load_model(str(path), device="cpu", dtype="fp32")
    assert loaded.config.tie_embeddings == model.config.tie_embeddings
    assert loaded.config.attention_bias == model.config.attention_bias
    _same_logits(model, loaded)


def test_hub_id_resolves_from_the_local_cache(tmp_path, monkeypatch):
    """A hub id found in the HF cache loads offline; one that is not there gives a clear error."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    model = random_model(CONFIGS["llama"])
    write_hf_dir(repo / "snapshots" / commit, model)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    source = resolve("acme/tiny-llama")
    assert source.format == "safetensors" and source.path.name == commit
    _same_logits(model, load_model("acme/tiny-llama", device="cpu", dtype="fp32"))
    with pytest.raises(ModelNotFoundError, match="not in the local Hugging Face cache"):
        resolve("acme/not-downloaded")


@pytest.mark.parametrize("spec", ["acme/tiny:../x.gguf", "acme/tiny:a/../../x.gguf", "acme/tiny:/etc/x.gguf",
                                  "acme/tiny:./x.gguf", "acme/tiny:a//x.gguf"])
def test_a_hub_file_outside_its_repository_is_refused(spec, monkeypatch):
    """A GGUF named in a hub id is a path inside the repository: '..' and the like are one error before the
    hub library is asked (it raised a ValueError of its own, a traceback)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="is not a path inside the repository"):
        resolve(spec)


def test_a_path_that_cannot_be_looked_at_is_one_error(tmp_path, monkeypatch):
    """A name past the file system's length (ENAMETOOLONG), a directory on the way without search permission
    (EACCES, root passes it: simulated): one error naming the path, not an OSError traceback."""
    with pytest.raises(ModelNotFoundError, match="cannot look there \\(File name too long"):
        resolve(str(tmp_path / ("a" * 300) / "model"))
    from pathlib import Path

    def denied(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "is_file", denied)
    with pytest.raises(ModelNotFoundError, match=f"^{tmp_path}/m: cannot look there \\(Permission denied: "):
        resolve(str(tmp_path / "m"))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q6_K"])
def test_block_dequantization_matches_gguf_reference(qtype):
    """Our torch unpacking of the common blocks agrees with the gguf package's numpy one."""
    from gguf import GGMLQuantizationType, quants
    from gguf.constants import GGML_QUANT_SIZES

    from llmrun.gguf_file import GGUFTensor

    t = GGMLQuantizationType[qtype]
    x = np.random.default_rng(0).standard_normal((6, 512)).astype(np.float32)
    try:
        blocks = quants.quantize(x, t)
    except NotImplementedError:
        pytest.skip(f"gguf cannot quantize {qtype}")
    tensor = GGUFTensor("w", (6, 512), int(t), blocks)
    expected = quants.dequantize(blocks, t)
    np.testing.assert_allclose(tensor.dequantize().numpy(), expected, rtol=0, atol=1e-6)
    err = np.abs(expected - x).max()
    assert err < {"Q8_0": 0.03, "Q6_K": 0.1}.get(qtype, 0.5)  # quantization itself is coarse
    assert blocks.shape[1] == 512 // GGML_QUANT_SIZES[t][0] * GGML_QUANT_SIZES[t][1]


def test_a_start_that_loads_and_decodes_imports_no_compiler():
    """torch._dynamo takes 2-3 s to import (nn.Embedding's init on the meta device pulled it in): a start that loads
    the embedded model and decodes must not import it."""
    code = ("import sys\nfrom llmrun.entry import main\n"
            "sys.argv = ['llmrun', 'generate', 'Hi', '-n', '2', '--device', 'cpu', '--threads', '1']\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print('\\ndynamo imported:', 'torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "dynamo imported: False"


def test_embedded_model_config(smollm2):
    cfg = smollm2.config
    assert (cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.dim, cfg.vocab_size) == (30, 9, 3, 576, 49152)
    assert cfg.tie_embeddings and cfg.max_seq_len == 8192
    assert open_model("smollm2").stored_bytes.keys() == {"F32", "Q4_1", "Q8_0"}


def test_unsupported_architecture_and_options():
    base = hf_config_json(CONFIGS["llama"])
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        config_from_hf({**base, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(UnsupportedModelError, match="activation"):
        config_from_hf({**base, "hidden_act": "gelu"})
    with pytest.raises(UnsupportedModelError, match="RoPE scaling 'longrope'"):
        config_from_hf({**base, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}})
    with pytest.raises(UnsupportedModelError, match="multiple"):
        config_from_hf({**base, "num_key_value_heads": 3})


def test_what_a_config_leaves_out_is_transformers_default():
    """max_position_embeddings and sliding_window absent: each family's transformers default (Llama 2048, no window;
    Mistral 131072, window 4096; Qwen2/Qwen3 32768, window 4096 where use_sliding_window asks for one); an
    explicit null sliding_window is no window."""
    want = {"llama": (2048, None), "mistral": (131072, 4096), "qwen2": (32768, 4096), "qwen3": (32768, 4096)}
    for arch, (context, window) in want.items():
        given = {k: v for k, v in hf_config_json(CONFIGS[arch]).items()
                 if k not in ("max_position_embeddings", "sliding_window")}
        extra = {"use_sliding_window": True, "max_window_layers": 1} if arch.startswith("qwen") else {}
        cfg = config_from_hf({**given, **extra})
        assert (cfg.max_seq_len, cfg.sliding_window) == (context, window), arch
        assert config_from_hf({**given, **extra, "sliding_window": None}).sliding_window is None


def test_rope_parameters_as_transformers_5_writes_them():
    """transformers >= 5 writes RoPE's base and scaling into one `rope_parameters` block, with no `rope_theta` or
    `rope_scaling` beside it."""
    cfg = CONFIGS["llama3.1"]  # llama3 scaling
    legacy = hf_config_json(cfg)
    rope = {"rope_theta": 500000.0, **legacy.pop("rope_scaling")}
    del legacy["rope_theta"]
    read = config_from_hf({**legacy, "rope_parameters": rope})
    assert read == replace(cfg, rope_theta=500000.0)
    plain = {**legacy, "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}
    assert (config_from_hf(plain).rope_theta, config_from_hf(plain).rope_scaling) == (100000.0, None)
    with pytest.raises(UnsupportedModelError, match="RoPE scaling 'dynamic'"):
        config_from_hf({**legacy, "rope_parameters": {"rope_theta": 1e6, "rope_type": "dynamic", "factor": 4.0}})
    yarn = config_from_hf({**legacy, "rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0}})
    assert yarn.rope_scaling.original_max_position == legacy["max_position_embeddings"]  # (transformers' default)
    with pytest.raises(UnsupportedModelError, match="rope_parameters"):  # one set per attention type
        config_from_hf({**legacy, "rope_parameters": {"full_attention": {"rope_theta": 1e6}}})
    with pytest.raises(ModelFormatError, match="rope_parameters.*factor"):
        config_from_hf({**legacy, "rope_parameters": {"rope_type": "linear"}})


def test_rope_parameters_from_transformers_itself():
    transformers = pytest.importorskip("transformers")  # installed locally for comparisons, not in CI
    if not hasattr(transformers.LlamaConfig(), "rope_parameters"):
        pytest.skip("transformers < 5 writes rope_theta and rope_scaling")
    cfg = replace(CONFIGS["llama3.1"], n_heads=4)  # transformers wants hidden_size = heads x head_dim
    written = transformers.LlamaConfig(**hf_config_json(cfg)).to_dict()
    assert "rope_parameters" in written and "rope_theta" not in written
    assert config_from_hf(written) == cfg


@pytest.mark.parametrize("change, words", [
    ({"num_hidden_layers": 0}, ["layer count", "0"]),
    ({"num_hidden_layers": -1}, ["layer count", "-1"]),
    ({"num_hidden_layers": None}, ["lacks num_hidden_layers"]),
    ({"vocab_size": "abc"}, ["vocab_size", "'abc'"]),
    ({"hidden_size": 64.5}, ["hidden_size", "64.5"]),
    ({"max_position_embeddings": 0}, ["context length"]),
    ({"rms_norm_eps": float("nan")}, ["rms_norm_eps", "nan"]),
    ({"rope_theta": -1.0}, ["RoPE base"]),
    ({"head_dim": 15}, ["head size 15", "odd"]),
    ({"rope_scaling": {"rope_type": "linear"}}, ["rope_scaling", "(it lacks factor)"]),
    ({"rope_scaling": "linear"}, ["rope_scaling", "'linear'"]),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, ["RoPE scaling factors 0.0"]),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 1,
                       "original_max_position_embeddings": 8192}}, ["low < high"]),
    ({"rope_parameters": {"rope_theta": "big"}}, ["rope_theta", "'big'"]),
    ({"tie_word_embeddings": "false"}, ["tie_word_embeddings is 'false', not true or false"]),
    ({"attention_bias": 1}, ["attention_bias is 1, not true or false"]),
    ({"architectures": [7]}, ["architectures is [7], not a list of names"]),
    ({"architectures": {"a": 1}}, ["architectures is {'a': 1}, not a list of names"]),
])
def test_invalid_config_values(change, words):
    """Whatever a config.json holds, a bad value is named, not a KeyError or TypeError from deep inside."""
    cfg = {**hf_config_json(CONFIGS["llama"]), **change}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(ModelFormatError) as e:
        config_from_hf(cfg)
    for word in words:
        assert word in str(e.value)


def test_one_architecture_name_outside_a_list():
    assert config_from_hf({**hf_config_json(CONFIGS["llama"]), "architectures": "LlamaForCausalLM"}) == CONFIGS["llama"]
    with pytest.raises(UnsupportedModelError, match="unsupported architecture 'GPT2LMHeadModel'"):
        config_from_hf({**hf_config_json(CONFIGS["llama"]), "architectures": "GPT2LMHeadModel"})


def test_qwen2_window_only_from_max_window_layers():
    """Qwen2 with use_sliding_window windows the layers from max_window_layers on (transformers' default 28),
    or those its layer_types name; a window no layer has is none."""
    base = {**hf_config_json(CONFIGS["qwen2"]), "use_sliding_window": True, "sliding_window": 5}
    assert config_from_hf({**base, "max_window_layers": 1}).layer_window(0) is None
    assert config_from_hf({**base, "max_window_layers": 1}).layer_window(1) == 5
    assert config_from_hf({**base, "max_window_layers": 0}).sliding_window_from == 0
    for unset in ({}, {"max_window_layers": 2}, {"max_window_layers": None}):  # 28 layers or more: none windowed
        cfg = config_from_hf({k: v for k, v in {**base, **unset}.items() if k != "max_window_layers" or unset})
        assert (cfg.sliding_window, cfg.sliding_window_from) == (None, 0)
    both = ["full_attention", "sliding_attention"]
    assert config_from_hf({**base, "max_window_layers": 0, "layer_types": both}).sliding_window_from == 1
    assert config_from_hf({**base, "layer_types": both[:1] * 2}).sliding_window is None
    assert config_from_hf({**base, "use_sliding_window": False, "layer_types": both}).sliding_window is None
    with pytest.raises(UnsupportedModelError, match="full-attention layers after a sliding-window one"):
        config_from_hf({**base, "layer_types": both[::-1]})
    with pytest.raises(ModelFormatError, match="layer_types .* not a list of 2"):
        config_from_hf({**base, "layer_types": ["sliding_attention"]})
    with pytest.raises(ModelFormatError, match="use_sliding_window is 'yes', not true or false"):
        config_from_hf({**base, "use_sliding_window": "yes"})
    with pytest.raises(ModelFormatError, match="sliding window from layer 2 of 2"):
        replace(CONFIGS["mistral"], sliding_window_from=2)
    with pytest.raises(ModelFormatError, match="sliding window from layer 1 of 2"):
        replace(CONFIGS["llama"], sliding_window_from=1)  # no window


def test_llama_has_no_window_and_rotates_whole_heads():
    """As transformers: LlamaForCausalLM reads no sliding_window (it windowed every layer); RoPE on part of each head
    (partial_rotary_factor) is refused, not run as whole-head RoPE."""
    base = hf_config_json(CONFIGS["llama"])
    assert config_from_hf({**base, "sliding_window": 4}).sliding_window is None
    assert config_from_hf({**hf_config_json(CONFIGS["mistral"]), "sliding_window": 4}).sliding_window == 4
    assert config_from_hf({**base, "partial_rotary_factor": 1.0}) == CONFIGS["llama"]
    default = {"rope_type": "default"}
    for where in ({"partial_rotary_factor": 0.5}, {"rope_parameters": {**default, "partial_rotary_factor": 0.5}},
                  {"partial_rotary_factor": 0.5, "rope_parameters": {**default, "partial_rotary_factor": None}}):
        with pytest.raises(UnsupportedModelError, match="partial_rotary_factor 0.5 .* not supported"):
            config_from_hf({**base, **where})
    with pytest.raises(UnsupportedModelError, match="sliding window cannot be written"):
        config_to_hf(replace(CONFIGS["llama"], sliding_window=4))


def test_qwen2_window_from_a_layer_round_trips_and_matches_transformers(tmp_path):
    """A Qwen2 directory whose second layer alone is windowed: read back equal, its logits those of the model
    written, and (where transformers is installed: locally, not in CI) those of transformers' Qwen2 (windowing
    every layer, as before, differs there)."""
    cfg = replace(CONFIGS["qwen2"], sliding_window=5, sliding_window_from=1)
    model = random_model(cfg)
    path = write_hf_dir(tmp_path / "qwen2", model)
    loaded = load_model(str(path), device="cpu", dtype="fp32")
    assert loaded.config == cfg
    _same_logits(model, loaded)
    # packed: the CPU's whole-stack call, which takes one window for all layers, is not used for its decode steps
    from llmrun.models.quant import QuantLinear

    packed = load_model(str(path), device="cpu", dtype="fp32", weights="int4").model
    assert isinstance(packed.layers[0].attn.qkv, QuantLinear)
    tokens = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = packed(tokens)[0]
    torch.testing.assert_close(decode_in_steps(packed, tokens, 3), full, atol=1e-4, rtol=1e-4)
    transformers = pytest.importorskip("transformers")
    (path / "config.json").write_text(json.dumps({**json.loads((path / "config.json").read_text()), "model_type": "qwen2"}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    tokens = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(tokens).logits
        torch.testing.assert_close(model(tokens), theirs, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(random_model(replace(cfg, sliding_window_from=0))(tokens), theirs, atol=1e-3)


@pytest.mark.parametrize("bias", [False, True])
def test_qwen3_round_trips_and_matches_transformers(tmp_path, bias):
    """Qwen3: each q and k head RMS-normalized before RoPE, heads wider than hidden / heads, attention_bias on all
    four projections. An HF directory and a GGUF (qwen3: Q/K rows not permuted, as llama.cpp's converter writes
    them) read back equal with the model's logits; packed and CPU-cached decoding agree with a full forward; and
    (where transformers is installed) the logits are transformers' Qwen3's."""
    cfg = replace(CONFIGS["qwen3"], attention_bias=bias, attention_out_bias=bias)
    model = random_model(cfg)
    path = write_hf_dir(tmp_path / "qwen3", model)
    written = json.loads((path / "config.json").read_text())
    assert written.get("attention_bias", False) is bias
    assert written["head_dim"] * written["num_attention_heads"] != written["hidden_size"]
    for source in (path, write_gguf(tmp_path / "qwen3.gguf", model, "qwen3")):
        _reads_back(model, source)
    tokens = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    packed = load_model(str(path), device="cpu", dtype="fp32", weights="int4").model
    with torch.no_grad():
        torch.testing.assert_close(decode_in_steps(packed, tokens, 3), packed(tokens)[0], atol=1e-4, rtol=1e-4)
        # the norms matter: without them the logits differ
        plain = random_model(replace(cfg, qk_norm=False))
        assert not torch.allclose(plain(tokens), model(tokens), atol=1e-2)
    assert config_from_hf({k: v for k, v in written.items() if k != "head_dim"}).head_dim == 128  # Qwen3Config's
    transformers = pytest.importorskip("transformers")
    (path / "config.json").write_text(json.dumps({**written, "model_type": "qwen3"}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    assert (hf.model.layers[0].self_attn.o_proj.bias is not None) is bias
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=1e-4, rtol=1e-4)


def test_yarn_as_transformers_and_llama_cpp_read_it(tmp_path, monkeypatch, capsys):
    """YaRN as Qwen's docs add it (factor 4 over the trained context, which max_position_embeddings keeps): the
    context runs to 4x; an HF directory and a GGUF (llama.cpp's keys) read back equal; the logits past the trained
    context are transformers' (where installed); the attention factor is on the forward's tables only, so a cached
    decode (and eviction's re-rotation: tests/test_kv_cache.py) agrees with a full forward."""
    cfg = CONFIGS["qwen3-yarn"]
    assert cfg.max_seq_len == 4 * cfg.rope_scaling.original_max_position
    written = hf_config_json(cfg)
    assert written["max_position_embeddings"] == 64 and config_from_hf(written) == cfg
    read = config_from_hf({**written, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 0.5,
                                                       "mscale_all_dim": 1.0, "beta_fast": 16, "truncate": False,
                                                       "original_max_position_embeddings": 64}}).rope_scaling
    assert (read.beta_fast, read.beta_slow, read.truncate) == (16.0, 1.0, False)
    assert read.attention_factor == pytest.approx((0.05 * math.log(4) + 1) / (0.1 * math.log(4) + 1))
    assert config_from_hf(config_to_hf(replace(cfg, rope_scaling=read))).rope_scaling == read
    model = random_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (1, 150), generator=torch.Generator().manual_seed(0))
    path = write_hf_dir(tmp_path / "yarn", model)
    for source in (path, write_gguf(tmp_path / "yarn.gguf", model, "qwen3")):
        _reads_back(model, source)
        code, out, err = run_main(["info", source, "--json"], monkeypatch, capsys)
        doc = json.loads(out)
        assert (doc["rope_scaling"], doc["rope_scaling_factor"], doc["context_length"], doc["qk_norm"]) == \
            ("yarn", 4.0, 256, True)
    with torch.no_grad():
        ours = model(tokens)
        torch.testing.assert_close(decode_in_steps(model, tokens[:, :80], 70), ours[0, :80], atol=1e-4, rtol=1e-4)
        unscaled = random_model(replace(cfg, rope_scaling=None))
        assert not torch.allclose(unscaled(tokens)[0, 70:], ours[0, 70:], atol=1e-2)
    transformers = pytest.importorskip("transformers")
    (path / "config.json").write_text(json.dumps({**written, "model_type": "qwen3"}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(ours, hf(tokens).logits, atol=1e-4, rtol=1e-4)


def test_yarn_settings_that_cannot_be_read_are_errors_and_gguf_keys_as_llama_cpp_reads_them(tmp_path):
    from llmrun.gguf_file import GGUFFile

    written = hf_config_json(CONFIGS["qwen3-yarn"])
    for factor, message in ((float("nan"), "RoPE scaling factors nan, 1.0, 4.0: each a positive number"),
                            (float("inf"), "RoPE scaling factors inf, 1.0, 4.0: each a positive number"),
                            (1e300, "makes a context of 6.4e\\+301")):
        with pytest.raises(ModelFormatError, match=message):
            config_from_hf({**written, "rope_scaling": {**written["rope_scaling"], "factor": factor}})
    for truncate in (None, 0, False):  # transformers: `if truncate:`
        rs = config_from_hf({**written, "rope_scaling": {**written["rope_scaling"], "truncate": truncate}}).rope_scaling
        assert rs.truncate is False
    # a GGUF: yarn_log_multiplier is DeepSeek's (llama.cpp reads it for no architecture llmrun runs); attn_factor
    # multiplies yarn's factor, and without yarn is refused (llama.cpp scales cos/sin by it)
    model = random_model(CONFIGS["qwen3-yarn"])
    plain = GGUFFile(write_gguf(tmp_path / "y.gguf", model, "qwen3")).metadata
    names = set(GGUFFile(tmp_path / "y.gguf").tensors)
    base = config_from_gguf(plain, names).rope_scaling
    assert config_from_gguf({**plain, "qwen3.rope.scaling.yarn_log_multiplier": 1.0}, names).rope_scaling == base
    scaled = config_from_gguf({**plain, "qwen3.rope.scaling.attn_factor": 1.5}, names).rope_scaling
    assert scaled.attention_factor == pytest.approx(1.5 * base.attention_factor)
    unscaled = {k: v for k, v in plain.items() if not k.startswith("qwen3.rope.scaling")}
    with pytest.raises(UnsupportedModelError, match="attn_factor .* is supported with yarn scaling only"):
        config_from_gguf({**unscaled, "qwen3.rope.scaling.attn_factor": 1.3}, names)


def test_llama_attention_bias_gives_all_four_projections_biases(tmp_path):
    """Llama's attention_bias puts a bias on q, k, v and o (transformers' LlamaAttention), Qwen2's q/k/v alone and
    Mistral none: each read back equal from an HF directory and a GGUF, its logits those of the model written,
    packed ones too, and (where transformers is installed: locally, not in CI) those of transformers' Llama."""
    cfg = replace(CONFIGS["llama"], attention_bias=True, attention_out_bias=True)
    model = random_model(cfg)
    path = write_hf_dir(tmp_path / "llama", model)
    assert json.loads((path / "config.json").read_text())["attention_bias"] is True
    for source in (path, write_gguf(tmp_path / "llama.gguf", model, "llama")):
        _reads_back(model, source)
    tokens = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    packed = load_model(str(path), device="cpu", dtype="fp32", weights="int4").model
    assert packed.layers[0].attn.o.bias is not None
    with torch.no_grad():
        torch.testing.assert_close(decode_in_steps(packed, tokens, 3), packed(tokens)[0], atol=1e-4, rtol=1e-4)
    base = hf_config_json(CONFIGS["llama"])
    assert config_from_hf({**base, "attention_bias": True}) == cfg
    mistral = config_from_hf({**base, "architectures": ["MistralForCausalLM"], "attention_bias": True})
    assert (mistral.attention_bias, mistral.attention_out_bias) == (False, False)  # transformers' Mistral has none
    qwen2 = config_from_hf({**base, "architectures": ["Qwen2ForCausalLM"]})
    assert (qwen2.attention_bias, qwen2.attention_out_bias) == (True, False)
    with pytest.raises(UnsupportedModelError, match="whose q/k/v projections have biases and whose output projection "
                                                    "lacks one cannot be written as an HF config.json"):
        config_to_hf(replace(cfg, attention_out_bias=False))  # (a GGUF Llama may hold such biases)
    transformers = pytest.importorskip("transformers")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    assert hf.model.layers[0].self_attn.o_proj.bias is not None
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=1e-4, rtol=1e-4)


def test_a_bias_the_config_does_not_give_is_named_as_stored(tmp_path):
    model = random_model(replace(CONFIGS["llama"], attention_bias=True, attention_out_bias=True))
    path = write_hf_dir(tmp_path / "llama", model)
    (path / "config.json").write_text(json.dumps({**json.loads((path / "config.json").read_text()),
                                                  "attention_bias": False}))
    with pytest.raises(ModelFormatError, match=r"tensor model\.layers\.0\.self_attn\.\w_proj\.bias does not belong "
                                               r"to a LlamaForCausalLM \(this architecture, as its config\.json "
                                               r"sets it up, gives that layer no bias\)"):
        load_model(str(path), device="cpu", dtype="fp32")


@pytest.mark.parametrize("stored", ["copy", "other"])
def test_a_tied_config_whose_checkpoint_stores_a_head(tmp_path, stored, monkeypatch, capsys):
    """tie_word_embeddings true, and lm_head.weight in the checkpoint as well: a copy of the embedding is tied (one
    matrix held), a head that differs is used (with a warning), as transformers 5 does; packed (an RTN checkpoint,
    the head as 8-bit blocks) as well as in floats."""
    from safetensors.torch import load_file, save_file

    from llmrun.models.quant import QuantEmbedding
    from llmrun.quantize import QuantizeOptions, quantize

    cfg = replace(CONFIGS["llama"], tie_embeddings=True, ffn_dim=128)  # (input widths 32 divides: 4-bit groups)
    tied = random_model(cfg)
    untied = random_model(replace(cfg, tie_embeddings=False), seed=1)
    with torch.no_grad():
        untied.embed.weight.copy_(tied.embed.weight)
        if stored == "copy":
            untied.lm_head.weight.copy_(tied.embed.weight)
        for name, p in untied.named_parameters():  # the rest as the tied model's
            if not name.startswith(("embed.", "lm_head.")):
                p.copy_(tied.get_parameter(name))
    path = write_hf_dir(tmp_path / "float", tied)
    save_file({**load_file(path / "model.safetensors"), "lm_head.weight": untied.lm_head.weight.contiguous()},
              str(path / "model.safetensors"))
    loaded = load_model(str(path), device="cpu", dtype="fp32")
    assert (loaded.model.lm_head is None, loaded.config.tie_embeddings) == (stored == "copy",) * 2
    assert loaded.model.config == loaded.config
    _same_logits(tied if stored == "copy" else untied, loaded)
    assert any("stores a different lm_head.weight: it is used" in n for n in loaded.notes) == (stored == "other")
    code, out, err = run_main(["info", path, "--json"], monkeypatch, capsys)  # (info reads no weights: it says so)
    assert code == 0 and json.loads(out)["tied_embeddings"] is True
    assert " ".join(err.split()).startswith("warning: config.json ties the output head to the embedding, but the "
                                            "checkpoint stores lm_head.weight too")
    quantize(str(write_hf_dir(tmp_path / "src", tied)), tmp_path / "q", QuantizeOptions("rtn"), device="cpu")
    q = tmp_path / "q" / "model.safetensors"
    save_file({**load_file(q), "lm_head.weight": untied.lm_head.weight.half().contiguous()}, str(q))
    packed = load_model(str(tmp_path / "q"), device="cpu", dtype="fp32")
    assert isinstance(packed.model.embed, QuantEmbedding) and packed.weights == "packed"
    assert (packed.model.lm_head is None) == (stored == "copy")


def test_invalid_gguf_metadata():
    meta = {"general.architecture": "llama", "llama.block_count": 2, "llama.context_length": 256,
            "llama.embedding_length": 64, "llama.feed_forward_length": 96, "llama.attention.head_count": 4,
            "llama.attention.layer_norm_rms_epsilon": 1e-5, "tokenizer.ggml.tokens": ["a"] * 128}
    assert config_from_gguf(meta, set()).n_layers == 2
    for key, value, words in [("llama.block_count", 0, "layer count"), ("llama.context_length", 0, "context length"),
                              ("llama.attention.head_count", "x", "head_count"),
                              ("tokenizer.ggml.tokens", None, "no tokenizer .* and no llama.vocab_size")]:
        with pytest.raises(ModelFormatError, match=words):
            config_from_gguf({k: v for k, v in {**meta, key: value}.items() if v is not None}, set())
    # RoPE on part of each head, values of another size than keys: refused (RoPE on part was run on the whole head)
    assert config_from_gguf({**meta, "llama.rope.dimension_count": 16, "llama.attention.value_length": 16},
                            set()).head_dim == 16
    for key in ("llama.rope.dimension_count", "llama.attention.value_length"):
        with pytest.raises(UnsupportedModelError, match=f"{key} 8 differs from the head size 16"):
            config_from_gguf({**meta, key: 8}, set())


def test_model_type_without_architectures():
    cfg = {**hf_config_json(CONFIGS["qwen2"]), "model_type": "qwen2"}
    del cfg["architectures"]
    assert config_from_hf(cfg).architecture == "Qwen2ForCausalLM"


def test_wrong_shape_of_a_fused_part_and_a_missing_part(tmp_path):
    """q/k/v and gate/up are checked one by one before their rows are concatenated, and named as the file names them."""
    from safetensors.torch import load_file, save_file

    path = write_hf_dir(tmp_path / "m", random_model(CONFIGS["llama"]))
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    save_file({**tensors, name: torch.zeros(7, 7)}, str(path / "model.safetensors"))
    with pytest.raises(ModelFormatError, match=rf"tensor {name} has shape \(7, 7\), the config implies \(96, 64\)"):
        load_model(str(path), device="cpu", dtype="fp32")
    save_file({k: v for k, v in tensors.items() if k != name}, str(path / "model.safetensors"))
    with pytest.raises(ModelFormatError, match=rf"missing tensors {name}$"):
        load_model(str(path), device="cpu", dtype="fp32")


@pytest.mark.parametrize("layers", [1, 3])
def test_a_config_with_another_layer_count(tmp_path, layers):
    path = write_hf_dir(tmp_path / "m", random_model(CONFIGS["llama"]))  # 2 layers
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    with pytest.raises(ModelFormatError, match=f"num_hidden_layers says {layers} layers, the weights have 2$"):
        load_model(str(path), device="cpu", dtype="fp32")


def test_gguf_block_count_against_its_tensors(tmp_path):
    import gguf

    path = write_gguf(tmp_path / "m.gguf", random_model(CONFIGS["llama"]))
    reader = gguf.GGUFReader(str(path), "r+")  # block_count is a uint32 field: rewrite its value in place
    reader.fields["llama.block_count"].parts[-1][0] = 3
    del reader
    with pytest.raises(ModelFormatError, match="llama.block_count says 3 layers, the weights have 2$"):
        load_model(str(path), device="cpu", dtype="fp32")


def test_the_index_is_checked_before_any_weight_is_read(tmp_path, monkeypatch):
    """What `info` reads (open_model) already finds a file without tensors or a vocabulary the embedding lacks."""
    from safetensors.torch import load_file, save_file

    from . import tiny

    model = random_model(CONFIGS["llama"])  # a vocabulary of 128, width 64
    model.config = replace(model.config, vocab_size=129)  # the file lists one token more than it embeds
    with pytest.raises(ModelFormatError, match=r"token_embd.weight has shape \(128, 64\), the config implies \(129,"):
        open_model(str(write_gguf(tmp_path / "vocab.gguf", model)))
    path = write_hf_dir(tmp_path / "m", random_model(CONFIGS["llama"]))
    tensors = load_file(path / "model.safetensors")
    save_file({**tensors, "model.embed_tokens.weight": torch.zeros(127, 64)}, str(path / "model.safetensors"))
    with pytest.raises(ModelFormatError, match=r"embed_tokens.weight has shape \(127, 64\), the config implies \(128,"):
        open_model(str(path))
    monkeypatch.setattr(tiny, "unfused_state_dict", lambda model: {})
    with pytest.raises(ModelFormatError, match="the weights hold no tensors"):
        open_model(str(write_gguf(tmp_path / "empty.gguf", random_model(CONFIGS["llama"]))))


def test_a_gguf_missing_tensors_names_them_as_gguf_does(tmp_path, monkeypatch):
    from . import tiny

    full = tiny.unfused_state_dict
    monkeypatch.setattr(tiny, "unfused_state_dict", lambda model: {k: v for k, v in full(model).items()
                                                                   if k not in ("layers.1.mlp.down.weight",
                                                                                "layers.0.attn.k.weight")})
    path = write_gguf(tmp_path / "m.gguf", random_model(CONFIGS["llama"]))
    for weights in ("auto", "dequant"):
        with pytest.raises(ModelFormatError, match="missing tensors blk.1.ffn_down.weight, blk.0.attn_k.weight$"):
            load_model(str(path), device="cpu", dtype="fp32", weights=weights)


def test_an_untied_config_without_a_head_says_what_ties_it(tmp_path):
    path = write_hf_dir(tmp_path / "m", random_model(CONFIGS["smollm2"]))  # tied: no lm_head.weight in the file
    config = json.loads((path / "config.json").read_text())
    del config["tie_word_embeddings"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFormatError, match="missing tensors lm_head.weight .*tie_word_embeddings true"):
        load_model(str(path), device="cpu", dtype="fp32")


def test_missing_shard(tmp_path):
    path = write_hf_dir(tmp_path / "m", random_model(CONFIGS["llama"]))
    weight_map = {"model.norm.weight": "model.safetensors", "lm_head.weight": "model-00002-of-00002.safetensors"}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelFormatError, match="missing shard model-00002-of-00002.safetensors"):
        open_model(str(path))


def test_a_sharded_directory_reads_the_files_its_index_lists(tmp_path):
    """The shards model.safetensors.index.json lists, and nothing beside them: a stale copy of the weights or
    Mistral's consolidated.safetensors would otherwise override or clash with them. Without an index,
    model.safetensors alone where it is, else every file; a tensor in two of them is an error."""
    from safetensors.torch import load_file, save_file

    from .tiny import shard_hf_dir

    model = random_model(CONFIGS["llama"])
    path = write_hf_dir(tmp_path / "m", model)
    tensors = load_file(path / "model.safetensors")
    stale = {k: torch.zeros_like(v) for k, v in tensors.items()}
    save_file(stale, str(path / "consolidated.safetensors"))
    _same_logits(model, load_model(str(path), device="cpu", dtype="fp32"))  # model.safetensors, not the other
    shard_hf_dir(path, 3)
    save_file(stale, str(path / "model-00001-of-00002.safetensors"))  # an older save's shard left behind
    _same_logits(model, load_model(str(path), device="cpu", dtype="fp32"))
    assert open_model(str(path)).stored_bytes == {"F32": sum(v.numel() * 4 for v in tensors.values())}

    for file in path.glob("*.safetensors"):  # no index, no model.safetensors: every file, each tensor in one
        file.unlink()
    (path / "model.safetensors.index.json").unlink()
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[::2]}, str(path / "a.safetensors"))
    save_file({k: tensors[k] for k in names[1::2]}, str(path / "b.safetensors"))
    _same_logits(model, load_model(str(path), device="cpu", dtype="fp32"))
    save_file({names[0]: tensors[names[0]]}, str(path / "c.safetensors"))
    with pytest.raises(ModelFormatError, match=f"tensor {names[0]} is in both a.safetensors and c.safetensors$"):
        open_model(str(path))


def test_an_index_naming_a_file_elsewhere_is_refused(tmp_path):
    path = write_hf_dir(tmp_path / "m", random_model(CONFIGS["llama"]))
    weight_map = {"model.norm.weight": "../other/model.safetensors"}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelFormatError, match="shard ../other/model.safetensors is not a file name of this dir"):
        open_model(str(path))
    # the directory's only weights elsewhere, by an absolute path: the index is named, not "no weights"
    (path / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    weight_map = {"model.norm.weight": str(tmp_path / "elsewhere.safetensors")}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelFormatError, match=f"shard {tmp_path}/elsewhere.safetensors is not a file name of this"):
        open_model(str(path))


def test_shape_mismatch(tmp_path):
    model = random_model(CONFIGS["llama"])
    path = write_hf_dir(tmp_path / "m", model)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 128}))
    with pytest.raises(ModelFormatError, match="shape"):
        load_model(str(path), device="cpu", dtype="fp32")


def test_truncated_safetensors(tmp_path):
    path = write_hf_dir(tmp_path / "m", random_model(CONFIGS["llama"]))
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFormatError, match="truncated"):
        open_model(str(path))


# --- progress ---------------------------------------------------------------------------------------------------


def assert_counts_up_to(calls: list[tuple], total: int) -> None:
    """`on_progress` calls: 0 first, then one per tensor, each with the tensor's name, up to `total`."""
    assert [done for done, _, _ in calls] == list(range(total + 1))
    assert {t for _, t, _ in calls} == {total}
    assert calls[0][2] == "" and all(name for _, _, name in calls[1:])


@pytest.mark.parametrize("fmt", ["gguf", "hf"])
@pytest.mark.parametrize("weights", ["auto", "dequant"])
def test_load_weights_reports_every_tensor_up_to_the_total(tmp_path, fmt, weights):
    from llmrun.loading import load_weights

    model = random_model(CONFIGS["llama"])
    path = write_gguf(tmp_path / "m.gguf", model, qtype="Q8_0") if fmt == "gguf" else write_hf_dir(tmp_path / "m", model)
    calls = []
    load_weights(open_model(str(path)), device="cpu", dtype="fp32", weights=weights,
                 on_progress=lambda *call: calls.append(call))
    # embedding, final norm, output head; per layer 2 norms and q, k, v, o, gate, up, down as the files store them
    assert_counts_up_to(calls, 3 + 9 * model.config.n_layers)


def test_weights_int4_rounds_the_float_matrices_and_keeps_4_bit_blocks(tmp_path):
    """`--weights int4`: a float model's matrices (head included) become 4-bit blocks of 32 run by the kernels, with
    the round-to-nearest error; matrices already in 4-bit blocks are kept bit for bit; the CPU needs fp32."""
    import dataclasses

    from llmrun.errors import LlmrunError
    from llmrun.models.quant import QuantLinear

    model = random_model(dataclasses.replace(CONFIGS["smollm2"], head_dim=32))
    f32 = write_gguf(tmp_path / "f32.gguf", model)
    loaded = load_model(str(f32), device="cpu", dtype="fp32", weights="int4")
    assert loaded.weights == "packed"
    linears = [m for name, m in loaded.model.named_modules() if name.startswith(("layers.", "lm_head"))
               and isinstance(m, (QuantLinear, torch.nn.Linear))]
    assert linears and all(isinstance(m, QuantLinear) and m.bits == 4 for m in linears)
    q41 = write_gguf(tmp_path / "q41.gguf", model, qtype="Q4_1")  # llama.cpp's rounding of the same scheme
    auto, int4 = (load_model(str(q41), device="cpu", dtype="fp32", weights=w).model for w in ("auto", "int4"))
    assert torch.equal(auto.layers[1].mlp.down.qs, int4.layers[1].mlp.down.qs)
    tokens = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(tokens)
        error, gguf_error = ((m(tokens) - want).norm() / want.norm() for m in (loaded.model, auto))
    assert 0 < error < 1.1 * gguf_error  # as close to the float model as llama.cpp's Q4_1 (this tiny model is touchy)

    with pytest.raises(LlmrunError, match="fp32"):
        load_model(str(f32), device="cpu", dtype="bf16", weights="int4")


def test_packed_kernels_exist_for_cpu_fp32_and_cuda():
    from llmrun.kernels import cpu
    from llmrun.loading import packed_kernels

    assert packed_kernels(torch.device("cpu"), torch.float32) == (None if cpu.available() else
                                                                 f"the CPU kernels are off ({cpu.unavailable_reason()})")
    assert "fp32" in packed_kernels(torch.device("cpu"), torch.bfloat16)
    assert packed_kernels(torch.device("cuda"), torch.bfloat16) is None  # Triton is installed with llmrun
    assert packed_kernels(torch.device("mps"), torch.float16) is not None


def test_random_weights_in_each_weight_mode():
    """`--random-weights`: float matrices run llmrun's ops (auto) or plain PyTorch (dequant), or 4-bit blocks."""
    from llmrun.models.quant import QuantLinear
    from llmrun.shapes import load_random, random_model_files

    import dataclasses

    files = random_model_files("qwen2.5-0.5b")
    files = dataclasses.replace(files, config=dataclasses.replace(files.config, n_layers=2))
    for weights, reference, packed in [("auto", False, False), ("dequant", True, False), ("int4", False, True)]:
        loaded = load_random(files, torch.device("cpu"), torch.float32, weights)
        assert loaded.model.reference_ops is reference
        assert isinstance(loaded.model.layers[0].mlp.down, QuantLinear) is packed
        assert loaded.weights == ("packed" if packed else "dequant")
    # int4 rounds each block as it is drawn: the same tensors as rounding the whole float model afterwards
    for shape in ("qwen2.5-0.5b", "smollm2-135m"):  # untied head with biases; tied head
        files = random_model_files(shape)
        files = dataclasses.replace(files, config=dataclasses.replace(files.config, n_layers=2))
        streamed = load_random(files, torch.device("cpu"), torch.float32, "int4").model.state_dict()
        afterwards = round_to_int4(load_random(files, torch.device("cpu"), torch.float32)).model.state_dict()
        assert streamed.keys() == afterwards.keys() and "lm_head.qs" in streamed
        assert all(torch.equal(streamed[k], afterwards[k]) for k in streamed), shape

