"""`llmrun eval`: the sliding windows, perplexity and KL against computations written out here (plain full
forwards of tiny random models, one per scored token), the JSON document, every bad input's one-line error,
the built-in corpus without network, and one run on the embedded model."""

import hashlib
import io
import json
import math
import subprocess
import sys
import tarfile
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from llmrun import corpus
from llmrun.errors import LlmrunError
from llmrun.eval import read_text, sliding_windows
from tests.conftest import run_main
from tests.tiny import CONFIGS, random_model, write_hf_dir

CFG = CONFIGS["llama"]  # untied output head, vocab 128, context 256
CPU = ("--device", "cpu")  # the numbers below are fp32 on CPU, also where a GPU is present
WORDS = [int(i) for i in np.random.default_rng(0).integers(0, CFG.vocab_size - 1, size=50)]  # 50 tokens


def text_of(ids) -> str:
    return " ".join(f"w{i}" for i in ids)  # the tiny tokenizer: word "wN" is token N, no BOS


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str

    @property
    def json(self) -> dict:
        assert self.code == 0, self.stderr
        lines = self.stdout.splitlines()
        assert len(lines) == 1, self.stdout  # one JSON document, nothing else on stdout
        return json.loads(lines[0])


@pytest.fixture
def cli(monkeypatch, capsys):
    """cli(*args) -> Outcome: `llmrun ARGS` through the entry point, in-process; an escaping exception becomes a
    traceback on stderr, as the interpreter would print it."""

    def run(*args) -> Outcome:
        return Outcome(*run_main(args, monkeypatch, capsys))

    return run


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny model as an HF directory, the model itself, and a text of WORDS."""
    root = tmp_path_factory.mktemp("eval")
    model = random_model(CFG, seed=0)
    (root / "text.txt").write_text(text_of(WORDS))
    return write_hf_dir(root / "model", model), model, root / "text.txt"


def hand_nlls(model, ids, ctx, stride) -> list[float]:
    """-log p(token t | its window) for t = 1..N-1, each from its own full forward. Token t is scored by the
    first window whose input holds token t-1: the one starting at the smallest multiple of stride >= t - ctx."""
    out = []
    with torch.no_grad():
        for t in range(1, len(ids)):
            start = stride * max(0, math.ceil((t - ctx) / stride))
            logits = model(torch.tensor([ids[start:t]]))[0, -1].double()
            out.append(-torch.log_softmax(logits, -1)[ids[t]].item())
    return out


# --- windows ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, ctx, stride", [(50, 16, 16), (50, 16, 5), (50, 16, 1), (50, 16, 8), (17, 16, 8),
                                            (18, 16, 16), (2, 16, 8), (10, 16, 3), (1000, 512, 256), (1001, 512, 512)])
def test_windows_score_every_token_after_the_first_exactly_once(n, ctx, stride):
    windows = sliding_windows(n, ctx, stride)
    scored = [t for w in windows for t in range(w.first_scored, w.end + 1)]
    assert scored == list(range(1, n))  # each once, in order
    for k, w in enumerate(windows):
        assert w.start == k * stride and 0 < w.end - w.start <= ctx and w.end <= n - 1
        assert w.first_scored > w.start  # a scored token's predecessor is in the window
        if k:  # outside the first window, every scored token sees at least ctx - stride earlier tokens
            assert w.first_scored - w.start >= ctx - stride + 1
    assert windows[-1].end == n - 1


def test_windows_of_too_short_a_text_and_bad_strides():
    assert sliding_windows(1, 16, 8) == [] and sliding_windows(0, 16, 8) == []
    for stride in (0, 17):
        with pytest.raises(ValueError):
            sliding_windows(50, 16, stride)


# --- perplexity -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ctx, stride", [(16, 5), (16, 16), (24, 7), (None, None)])
def test_ppl_equals_a_hand_computation(cli, tiny, ctx, stride):
    path, model, text = tiny
    args = (["--ctx", ctx] if ctx else []) + (["--stride", stride] if stride else [])
    doc = cli("eval", path, *CPU, "--ppl", text, "--json", *args).json
    ctx, stride = ctx or CFG.max_seq_len, stride or (ctx or CFG.max_seq_len) // 2  # defaults: the model's 256, half
    nlls = hand_nlls(model, WORDS, ctx, stride)
    assert (doc["ctx"], doc["stride"]) == (ctx, stride)
    assert doc["text"] == {"source": str(text), "tokens": 50, "evaluated": 49}
    assert doc["nll"] == pytest.approx(sum(nlls) / len(nlls), abs=1e-5)
    assert doc["ppl"] == pytest.approx(math.exp(sum(nlls) / len(nlls)), rel=1e-5)
    assert doc["windows"] == len(sliding_windows(50, ctx, stride))


def test_a_model_with_a_context_of_one_position(cli, tiny, tmp_path):
    """Its default stride, half the window, was 0: a traceback. Each token is then scored from the one before."""
    _, model, text = tiny
    path = write_hf_dir(tmp_path / "ctx1", model)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1}))
    doc = cli("eval", path, *CPU, "--ppl", text, "--json").json
    nlls = hand_nlls(model, WORDS, 1, 1)
    assert (doc["ctx"], doc["stride"], doc["windows"]) == (1, 1, 49)
    assert doc["nll"] == pytest.approx(sum(nlls) / len(nlls), abs=1e-5)


def test_a_model_that_predicts_nothing_has_the_vocabulary_size_as_perplexity(cli, tmp_path):
    """Zero output weights: every next-token distribution is uniform over 128 tokens, so ppl = 128 exactly."""
    model = random_model(CFG, seed=0)
    with torch.no_grad():
        model.lm_head.weight.zero_()
    (tmp_path / "t.txt").write_text(text_of(WORDS))
    doc = cli("eval", write_hf_dir(tmp_path / "m", model), *CPU, "--ppl", tmp_path / "t.txt", "--ctx", 16, "--json").json
    assert doc["ppl"] == pytest.approx(128.0, rel=1e-6)
    assert doc["nll"] == pytest.approx(math.log(128), rel=1e-6)


def test_a_perplexity_past_float64_is_null_not_a_traceback(cli, tiny, tmp_path):
    """A head scaled until the text's mean NLL passes ~709.8 nats: exp overflows (an OverflowError traceback);
    `ppl` is null (and `ppl_reference`, as the reference), `nll` given, the table says so in words."""
    path, model, text = tiny
    hot = random_model(CFG, seed=0)
    with torch.no_grad():
        hot.lm_head.weight.mul_(2000)
    hot = write_hf_dir(tmp_path / "hot", hot)
    out = cli("eval", hot, *CPU, "--ppl", text, "--ctx", 16, "--kl-vs", f"model={hot}", "--json")
    doc = out.json
    assert doc["nll"] > 709.8 and doc["ppl"] is None and doc["kl"]["ppl_reference"] is None
    assert "past float64's range" in out.stderr


def test_a_model_whose_output_is_not_finite_is_refused(cli, tiny, tmp_path):
    """A NaN in the weights makes NaN scores: one error line, as chat gives, not a perplexity of nan; as the
    reference of --kl-vs too, and under `llmrun bench`."""
    path, model, text = tiny
    broken = random_model(CFG, seed=0)
    with torch.no_grad():
        broken.norm.weight[3] = float("nan")
    broken = write_hf_dir(tmp_path / "nan", broken)
    for args in (("eval", broken, *CPU, "--ppl", text, "--ctx", 16),
                 ("eval", path, *CPU, "--ppl", text, "--ctx", 16, "--kl-vs", f"model={broken}"),
                 ("bench", broken, *CPU, "--prompt-tokens", 8, "--new-tokens", 4, "--repeat", 1)):
        out = cli(*args)
        assert out.code == 1 and "not finite" in out.stderr and "Traceback" not in out.stderr, args
        assert out.stdout == ""


def test_max_tokens_scores_the_first_n(cli, tiny):
    path, model, text = tiny
    doc = cli("eval", path, *CPU, "--ppl", text, "--ctx", 16, "--max-tokens", 20, "--json").json
    assert doc["text"] == {"source": str(text), "tokens": 50, "evaluated": 20}
    nlls = hand_nlls(model, WORDS[:21], 16, 8)
    assert doc["nll"] == pytest.approx(sum(nlls) / 20, abs=1e-5)
    assert cli("eval", path, *CPU, "--ppl", text, "--max-tokens", 1000, "--json").json["text"]["evaluated"] == 49


def test_max_tokens_tokenizes_a_prefix_of_a_long_text(embedded_path):
    """With --max-tokens, a prefix of the text long enough is tokenized (a 28 MB file took 4.3 GB to score 64
    tokens): its first ids are the whole text's; the whole text's count is then unknown (null), and known where the
    prefix reached the end."""
    from llmrun.cli.eval import _text_ids
    from llmrun.loading import open_model

    tok = open_model(str(embedded_path)).tokenizer
    text = "".join(f"Paragraph {i}: the quick brown fox, 12345 naïve words.\n\n" for i in range(3000))
    whole = tok.encode(text)
    for n in (1, 50, 2000):
        assert _text_ids(tok, text, n) == (whole[: n + 1], None)
    assert _text_ids(tok, text, len(whole) + 5) == (whole, len(whole))
    assert _text_ids(tok, text, None) == (whole, len(whole))


def test_json_document(cli, tiny):
    path, _, text = tiny
    doc = cli("eval", path, *CPU, "--ppl", text, "--ctx", 16, "--json").json
    assert list(doc) == ["model", "config", "text", "ctx", "stride", "windows", "nll", "ppl", "seconds", "tok_s", "kl"]
    assert doc["model"] == str(path)
    assert doc["config"] == {"device": "cpu", "dtype": "fp32", "weights": "auto", "weights_loaded": "dequant",
                             "kv": "fp32", "kv_eviction": None}
    assert (doc["ctx"], doc["stride"], doc["windows"]) == (16, 8, 6)  # windows start at 0, 8, ..., 40; the last scores token 49 alone
    assert doc["seconds"] > 0 and doc["tok_s"] > 0 and doc["kl"] is None


def test_the_table_goes_to_stderr(cli, tiny):
    path, _, text = tiny
    result = cli("eval", path, *CPU, "--ppl", text, "--ctx", 16, "--kl-vs", "dtype=fp32")
    assert result.code == 0 and result.stdout == ""
    for row in ("perplexity", "windows", "6 of up to 16 tokens, stride 8", "49 evaluated", "top-1 agreement", "100.00 %"):
        assert row in result.stderr


# --- KL divergence ----------------------------------------------------------------------------------------------


def test_kl_of_a_configuration_against_itself_is_zero(cli, tiny):
    path, _, text = tiny
    for reference in ("dtype=fp32", f"model={path}", "device=cpu,weights=auto"):
        doc = cli("eval", path, *CPU, "--ppl", text, "--ctx", 16, "--json", "--kl-vs", reference).json
        kl = doc["kl"]
        assert kl["mean"] == kl["max"] == kl["p99"] == 0.0
        assert kl["top1_agreement"] == 1.0 and kl["ppl_reference"] == doc["ppl"]
    assert kl["reference"] == {"model": str(path), "device": "cpu", "dtype": "fp32", "weights": "auto",
                               "weights_loaded": "dequant", "kv": "fp32", "kv_eviction": None}  # float weights: nothing to pack


def test_kl_against_another_model_equals_a_hand_computation(cli, tiny, tmp_path):
    """Two random models of the same shape: KL(P_ref || P) per token from full forwards, summed by hand."""
    path, model, text = tiny
    other = random_model(CFG, seed=1)
    doc = cli("eval", path, *CPU, "--ppl", text, "--ctx", 16, "--stride", 6, "--json",
              "--kl-vs", f"model={write_hf_dir(tmp_path / 'other', other)}").json
    kls, same = [], []
    with torch.no_grad():
        for t in range(1, len(WORDS)):
            start = 6 * max(0, math.ceil((t - 16) / 6))
            x = torch.tensor([WORDS[start:t]])
            p, r = (torch.log_softmax(m(x)[0, -1].double(), -1) for m in (model, other))
            kls.append(sum(math.exp(r[v]) * (r[v] - p[v]) for v in range(CFG.vocab_size)).item())
            same.append(bool(p.argmax() == r.argmax()))
    kl = doc["kl"]
    assert kl["mean"] == pytest.approx(np.mean(kls), rel=1e-4)
    assert kl["max"] == pytest.approx(max(kls), rel=1e-4)
    assert kl["p99"] == pytest.approx(np.percentile(kls, 99), rel=1e-4)
    assert kl["top1_agreement"] == pytest.approx(np.mean(same))
    other_nll = np.mean(hand_nlls(other, WORDS, 16, 6))
    assert kl["ppl_reference"] == pytest.approx(math.exp(other_nll), rel=1e-5)
    assert kl["mean"] > 0.1  # two unrelated models really differ


def test_kl_of_kv_cache_options(cli, tiny, tmp_path):
    """The cache is what differs: an int8 cache against the fp32 one; an evicting cache against one that keeps
    every token, exactly equal while the budget holds the whole window, apart once tokens are dropped."""
    path, _, _ = tiny
    (tmp_path / "long.txt").write_text(text_of(WORDS * 4))  # 200 tokens
    base = ("eval", path, *CPU, "--ppl", tmp_path / "long.txt", "--json")
    doc = cli(*base, "--ctx", 64, "--kv", "int8", "--kl-vs", "kv=auto").json
    assert (doc["config"]["kv"], doc["kl"]["reference"]["kv"]) == ("int8", "fp32")
    assert 0 < doc["kl"]["mean"] < 0.01
    window = {"policy": "window", "budget": 64, "sinks": 4}
    for ctx, exact in ((64, True), (128, False)):
        result = cli(*base, "--ctx", ctx, "--kv-evict", "window", "--kv-budget", 64, "--kl-vs", "kv-evict=none")
        doc = result.json
        assert (doc["config"]["kv_eviction"], doc["kl"]["reference"]["kv_eviction"]) == (window, None)
        assert (doc["kl"]["max"] == 0.0) == exact, doc["kl"]
        assert ("nothing is evicted" in result.stderr) == exact  # (said: the budget holds the whole window)
        if exact:  # in one line, and only the change that can be made: no budget below 64 exists
            [note] = [line for line in result.stderr.splitlines() if line.startswith("note: --kv-budget")]
            assert note.endswith("nothing is evicted; a --ctx above 64 measures eviction")
    doc = cli(*base, "--ctx", 128, "--kv-evict", "window", "--kv-budget", 64, "--kl-vs", "kv-evict=h2o").json
    assert doc["kl"]["reference"]["kv_eviction"] == {**window, "policy": "h2o"} and doc["kl"]["mean"] > 0


def test_kl_against_bf16_is_small_but_not_zero(cli, tiny):
    path, _, text = tiny
    doc = cli("eval", path, *CPU, "--ppl", text, "--ctx", 16, "--json", "--kl-vs", "dtype=bf16").json
    kl = doc["kl"]
    assert kl["reference"]["dtype"] == "bf16"
    assert 0 < kl["mean"] <= kl["p99"] <= kl["max"] < 0.05  # bf16 keeps ~3 significant digits of each logit
    assert kl["top1_agreement"] >= 0.8
    assert kl["ppl_reference"] == pytest.approx(doc["ppl"], rel=0.05)


# --- bad input: one `error:` line, nothing on stdout, no traceback ----------------------------------------------


def assert_error(result: Outcome, code: int, *fragments: str):
    lines = result.stderr.splitlines()
    assert result.code == code, result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert result.stdout == "" and "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory, tiny):
    """Texts a model cannot be evaluated on, and reference models that cannot be compared with the tiny one."""
    root = tmp_path_factory.mktemp("bad")
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (root / "empty.txt").write_text("")
    (root / "nul.txt").write_bytes(b"w1 w2\x00w3")
    (root / "one.txt").write_text("w7")
    write_hf_dir(root / "small-vocab", random_model(replace(CFG, vocab_size=64)))
    shuffled = write_hf_dir(root / "shuffled", tiny[1])  # the same model, its words numbered the other way
    tok = json.loads((shuffled / "tokenizer.json").read_text())
    tok["model"]["vocab"] = {f"w{i}": CFG.vocab_size - 2 - i for i in range(CFG.vocab_size - 1)} | {"<eos>": CFG.vocab_size - 1}
    (shuffled / "tokenizer.json").write_text(json.dumps(tok))
    return root


@pytest.mark.parametrize("args, code, fragments", [
    ([], 2, ["Missing option '--ppl'"]),
    (["--ppl", "{root}/missing.txt"], 1, ["missing.txt: no such file"]),
    (["--ppl", "{root}"], 1, ["is a directory"]),
    (["--ppl", ""], 1, ["the text file's name is empty"]),
    (["--ppl", "{root}/latin1.txt"], 1, ["latin1.txt is not UTF-8 text (byte 0xe9 at offset 3)"]),
    (["--ppl", "{root}/empty.txt"], 1, ["empty.txt is empty"]),
    (["--ppl", "{root}/nul.txt"], 1, ["looks binary"]),
    (["--ppl", "{root}/one.txt"], 1, ["too short: 1 token(s); at least 2"]),
    (["--ppl", "canterbury:nope"], 1, ["unknown canterbury text 'nope'; choose one of alice29, asyoulik, lcet10, plrabn12"]),
    (["--ppl", "canterbury:"], 1, ["unknown canterbury text ''; choose one of"]),
    (["--ppl", "{text}", "--max-tokens", "0"], 2, ["'--max-tokens'"]),
    (["--ppl", "{text}", "--stride", "0", "--ctx", "16"], 2, ["'--stride'", "0 is not between 1 and the window --ctx 16"]),
    (["--ppl", "{text}", "--stride", "17", "--ctx", "16"], 2, ["17 is not between 1 and the window --ctx 16"]),
    (["--ppl", "{text}", "--stride", "300"], 2, ["300 is not between 1 and the window --ctx 256"]),  # the tiny model's
    (["--ppl", "{text}", "--ctx", "8"], 2, ["'--ctx'"]),
    (["--ppl", "{text}", "--ctx", "1000"], 2, ["--ctx 1000 exceeds the model's context of 256 tokens"]),
    (["--ppl", "{text}", "--kl-vs", ""], 2, ["'--kl-vs'", "'' is not key=value"]),
    (["--ppl", "{text}", "--kl-vs", "dtype"], 2, ["'dtype' is not key=value", "e.g. --kl-vs dtype=fp32"]),
    (["--ppl", "{text}", "--kl-vs", "dtype="], 2, ["'dtype=' is not key=value"]),
    (["--ppl", "{text}", "--kl-vs", "dtype=bf16,"], 2, ["'' is not key=value"]),
    (["--ppl", "{text}", "--kl-vs", "ctx=16"], 2, ["unknown key 'ctx'; valid keys: model, device, dtype, weights, kv, kv-evict"]),
    (["--ppl", "{text}", "--kl-vs", "kv=int3"], 2, ["kv=int3: choose kv from auto, fp32, bf16, fp16, int8, int4"]),
    (["--ppl", "{text}", "--kl-vs", "kv-evict=h2o"], 2, ["kv-evict=h2o takes this run's --kv-budget"]),
    (["--ppl", "{text}", "--kl-vs", "dtype=fp8"], 2, ["dtype=fp8: choose dtype from auto, bf16, fp16, fp32"]),
    (["--ppl", "{text}", "--kl-vs", "weights=int3"], 2, ["weights=int3: choose weights from auto, dequant, int4"]),
    (["--ppl", "{text}", "--kl-vs", "dtype=bf16,dtype=fp32"], 2, ["dtype is given twice"]),
    (["--ppl", "{text}", "--kl-vs", "model={root}/nothing.gguf"], 1, ["nothing.gguf: no such file or directory"]),
    (["--ppl", "{text}", "--kl-vs", "model={root}/small-vocab"], 1, ["has 64 tokens in its vocabulary, this one 128"]),
    (["--ppl", "{text}", "--kl-vs", "model={root}/shuffled"], 1, ["tokenizes the text differently"]),
    (["--ppl", "{text}", "--kl-vs", "device=cuda"], 1, ["--kl-vs device=cuda: no CUDA device"]),
])
def test_bad_input_gives_one_error_line(cli, tiny, bad_inputs, args, code, fragments):
    if "device=cuda" in args and torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    args = [a.format(root=bad_inputs, text=tiny[2]) for a in args]
    assert_error(cli("eval", tiny[0], *CPU, *args), code, *fragments)


def test_a_reference_with_a_shorter_context_bounds_the_windows(cli, tiny, tmp_path):
    """Both models score the same windows: the default --ctx is the shorter context's, and a --ctx past the
    reference's is named as the reference's (not this model's) limit, before either model loads."""
    path, _, text = tiny
    short = write_hf_dir(tmp_path / "short", random_model(replace(CFG, max_seq_len=64), seed=1))
    assert_error(cli("eval", path, *CPU, "--ppl", text, "--ctx", 128, "--kl-vs", f"model={short}"), 2,
                 f"--ctx 128 exceeds the reference's (--kl-vs model={short}) context of 64 tokens")
    doc = cli("eval", path, *CPU, "--ppl", text, "--json", "--kl-vs", f"model={short}").json
    assert doc["ctx"] == 64 and doc["kl"] is not None


def test_an_unreadable_file(cli, tiny, monkeypatch):
    path, _, text = tiny

    import llmrun.errors

    def denied(path, name):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(llmrun.errors, "read_text_bytes", denied)  # chmod would not stop root
    assert_error(cli("eval", path, *CPU, "--ppl", text), 1, f"cannot read {text} (Permission denied)")


# --- the built-in corpus, without network ---------------------------------------------------------------------

ALICE = "ALICES ADVENTURES\r\n\r\nw1 w2 w3 w4 w5 w6 w7 w8 w9 w10\r\n"


def fake_sdist(path, texts=corpus.TEXTS):
    """A tarball laid out like the brotli sdist: texts (CRLF, as there) among other test data."""
    with tarfile.open(path, "w:gz") as tar:
        members = {f"{name}.txt": (ALICE if name == "alice29" else f"{name} w1 w2\r\n") for name in texts}
        members |= {"x.compressed": "\x00\x01", "../../evil.txt": "no"}
        for name, content in members.items():
            data = content.encode()
            info = tarfile.TarInfo(f"Brotli-{corpus.BROTLI_VERSION}/tests/testdata/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def offline_corpus(tmp_path, monkeypatch):
    """The cache in tmp_path; `pip download` replaced by a copy of a fake sdist, pinned by its sha256. Returns
    the list of downloads made."""
    sdist = fake_sdist(tmp_path / corpus.BROTLI_SDIST)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(corpus, "BROTLI_SHA256", hashlib.sha256(sdist.read_bytes()).hexdigest())
    downloads = []

    def download(dest):
        downloads.append(dest)
        (dest / sdist.name).write_bytes(sdist.read_bytes())
        return dest / sdist.name

    monkeypatch.setattr(corpus, "_download_sdist", download)
    return downloads


def test_the_corpus_is_fetched_once_then_read_from_the_cache(offline_corpus, tmp_path):
    assert read_text("canterbury") == ALICE.replace("\r\n", "\n")  # the default text, newlines made \n
    assert read_text("canterbury:alice29") == ALICE.replace("\r\n", "\n")
    assert read_text("canterbury:lcet10") == "lcet10 w1 w2\n"
    assert len(offline_corpus) == 1
    cached = sorted(p.name for p in (tmp_path / "cache" / "llmrun" / "corpus").iterdir())
    assert cached == sorted(f"{name}.txt" for name in corpus.TEXTS)  # nothing else, nothing outside
    assert not (tmp_path / "evil.txt").exists()


def test_a_byte_order_mark_is_not_text(tmp_path):
    (tmp_path / "bom.txt").write_bytes("\ufeffOne\r\ntwo\n".encode())
    assert read_text(str(tmp_path / "bom.txt")) == "One\ntwo\n"
    (tmp_path / "only.txt").write_bytes("\ufeff".encode())
    with pytest.raises(LlmrunError, match="is empty"):
        read_text(str(tmp_path / "only.txt"))


def test_eval_on_the_corpus(cli, tiny, offline_corpus):
    doc = cli("eval", tiny[0], *CPU, "--ppl", "canterbury", "--json").json
    assert doc["text"]["source"] == "canterbury" and doc["text"]["evaluated"] == len(ALICE.split()) - 1


def test_a_sdist_with_another_sha256_is_refused(offline_corpus, monkeypatch):
    monkeypatch.setattr(corpus, "BROTLI_SHA256", "0" * 64)
    with pytest.raises(LlmrunError, match=r"has sha256 .* not the pinned 0000000000000000\.\.\. of brotli .* --ppl FILE"):
        read_text("canterbury")
    assert not corpus.cache_dir().exists() or not any(corpus.cache_dir().iterdir())


def test_a_sdist_without_the_texts_is_refused(offline_corpus, tmp_path, monkeypatch):
    sdist = fake_sdist(tmp_path / "partial.tar.gz", texts=("alice29",))
    monkeypatch.setattr(corpus, "BROTLI_SHA256", hashlib.sha256(sdist.read_bytes()).hexdigest())
    with pytest.raises(LlmrunError, match="has no tests/testdata/asyoulik.txt"):
        corpus.fetch(sdist)


def test_pip_failing_gives_one_line_saying_what_to_do(cli, tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def pip(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, 1, "", "WARNING: retrying\nERROR: No matching distribution found for brotli==1.1.0\n")

    monkeypatch.setattr(corpus.subprocess, "run", pip)
    result = cli("eval", tiny[0], *CPU, "--ppl", "canterbury:asyoulik")
    assert_error(result, 1, "cannot download the brotli 1.1.0 sdist from PyPI (ERROR: No matching distribution",
                 "python -m llmrun.corpus Brotli-1.1.0.tar.gz", "or use --ppl FILE")
    assert calls[0][1:] == ["-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet", "brotli==1.1.0", "-d", calls[0][-1]]


def test_the_corpus_script(offline_corpus, tmp_path, capsys):
    sdist = tmp_path / corpus.BROTLI_SDIST
    assert corpus.main([str(sdist)]) == 0  # a hand-downloaded sdist: no download
    assert corpus.main([]) == 0  # all cached: no download either
    assert offline_corpus == []
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 8 and out[0].startswith("canterbury:alice29  (default)") and "lcet10.txt" in out[2]
    assert corpus.main(["--help"]) == 2


# --- end to end --------------------------------------------------------------------------------------------------


def test_eval_on_the_embedded_model(cli, tmp_path):
    text = tmp_path / "alice.txt"
    text.write_text("Alice was beginning to get very tired of sitting by her sister on the bank, and of having "
                    "nothing to do: once or twice she had peeped into the book her sister was reading, but it had "
                    "no pictures or conversations in it, 'and what is the use of a book,' thought Alice 'without "
                    "pictures or conversations?' So she was considering in her own mind.")
    doc = cli("eval", "--ppl", text, "--max-tokens", 64, "--ctx", 32, "--json").json
    assert doc["model"] == "smollm2" and doc["text"]["evaluated"] == 64 and doc["text"]["tokens"] > 65
    assert (doc["ctx"], doc["stride"], doc["windows"]) == (32, 16, 3)
    assert 1.5 < doc["ppl"] < 100  # a 135M model on plain English prose


def test_help_does_not_import_torch():
    script = ("import sys\nfrom llmrun.cli import main\nsys.argv = ['llmrun', 'eval', '--help']\n"
              "try:\n    main()\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules, file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.stderr.strip() == "False" and "--kl-vs" in result.stdout
