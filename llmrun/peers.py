"""Other engines on the same model, prompt ids and thread count, for `llmrun bench --compare`: llama.cpp
(through llama-cpp-python) and Hugging Face transformers.

Neither is a dependency of llmrun. A peer that is not installed, or that cannot run this model, gives a row
that says why it was skipped — never an error: a failure inside a third-party engine is reported in one line
and the comparison goes on. Each peer is a Runner for `llmrun.bench.time_runs` (greedy, exactly new_tokens
tokens, the same warm-up and repeats), so its figures mean what llmrun's do.
"""

from __future__ import annotations

import io
from contextlib import redirect_stderr
from pathlib import Path

PEERS = ("llama.cpp", "transformers")


class PeerSkipped(Exception):
    """Why a peer cannot run here; becomes the row's `skipped` text (and `version` its version, when installed)."""

    def __init__(self, message: str, version: str | None = None):
        super().__init__(message)
        self.version = version


def _one_line(e: BaseException) -> str:
    from llmrun.bench import one_line

    return one_line(e, with_type=True)


def row(name: str, config: str, figures: dict | None = None, *, version: str | None = None,
        skipped: str | None = None) -> dict:
    """One line of the comparison: speed figures, or None's and the reason it was skipped."""
    speed = {key: (figures or {}).get(key) for key in ("ttft_s", "prefill_tok_s", "decode_tok_s", "e2e_tok_s")}
    return {"name": name, "version": version, "config": config, "skipped": skipped, **speed,
            "decode_ratio": None, "prefill_ratio": None}


def add_ratios(rows: list[dict]) -> list[dict]:
    """Each row's decode and prefill speed as a multiple of the first row's (llmrun as configured)."""
    base = rows[0]
    for r in rows:
        if r["skipped"] is None and base["skipped"] is None:
            r["decode_ratio"] = round(r["decode_tok_s"]["median"] / base["decode_tok_s"]["median"], 3)
            r["prefill_ratio"] = round(r["prefill_tok_s"] / base["prefill_tok_s"], 3)
    return rows


def peer_rows(files, settings, workload, progress=lambda message: None) -> list[dict]:
    """A row per peer in PEERS, measured on `workload` with the resolved llmrun `settings`' device, dtype,
    threads and context."""
    from llmrun import bench

    rows = []
    for name, start in (("llama.cpp", _start_llama_cpp), ("transformers", _start_transformers)):
        progress(f"compare: {name}")
        try:
            runner, version, config = start(files, settings)
        except PeerSkipped as e:
            rows.append(row(name, "", version=e.version, skipped=str(e)))
            continue
        try:
            with bench.torch_threads(settings.threads):
                figures = bench.speed_figures(bench.time_runs(runner, workload))
            rows.append(row(name, config, figures, version=version))
        except Exception as e:  # a third-party engine's failure: reported, never fatal
            rows.append(row(name, config, version=version, skipped=f"{name} failed: {_one_line(e)}"))
        finally:
            runner.close()
            del runner
            bench.release(settings.device)
    return rows


# --- llama.cpp ----------------------------------------------------------------------------------------------------


class LlamaCppRunner:
    """llama.cpp's low-level API: eval() the prompt, then one token at a time; logits only for the last token."""

    def __init__(self, llama_cpp, path: Path, settings):
        self.llama_cpp = llama_cpp
        self.llm = llama_cpp.Llama(
            model_path=str(path), n_ctx=settings.ctx, n_threads=settings.threads, n_threads_batch=settings.threads,
            n_gpu_layers=-1 if settings.device == "cuda" else 0, logits_all=False, verbose=False,
        )
        self.n_vocab = self.llm.n_vocab()

    def reset(self) -> None:
        self.llm.reset()

    def prefill(self, ids: list[int]):
        self.llm.eval(ids)  # returns when the batch is computed

    def decode(self, token: int):
        self.llm.eval([token])

    def argmax(self, _logits) -> int:
        import numpy as np

        pointer = self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.ctypeslib.as_array(pointer, shape=(self.n_vocab,)).argmax())

    def sync(self) -> None:
        pass

    def close(self) -> None:
        self.llm.close()


def _start_llama_cpp(files, settings):
    if files.source.format == "random":
        raise PeerSkipped("llama.cpp reads GGUF files; random weights have none")
    if files.source.format != "gguf":
        raise PeerSkipped(f"llama.cpp reads GGUF files, the model is {files.source.format}")
    try:
        import llama_cpp
    except ImportError:
        raise PeerSkipped("llama-cpp-python not installed (pip install llama-cpp-python)") from None
    try:
        runner = LlamaCppRunner(llama_cpp, files.source.path, settings)
    except Exception as e:  # a third-party engine's failure: reported, never fatal
        raise PeerSkipped(f"llama.cpp failed to load the model: {_one_line(e)}", llama_cpp.__version__) from None
    stored = "+".join(sorted(files.stored_bytes)) or "?"
    offload = ""
    if settings.device == "cuda":  # a CPU-only build of llama.cpp ignores n_gpu_layers: say where it ran
        offload = ", all layers on the GPU" if llama_cpp.llama_supports_gpu_offload() else ", CPU-only build: on the CPU"
    return runner, llama_cpp.__version__, f"GGUF as stored ({stored}){offload}"


# --- transformers ---------------------------------------------------------------------------------------------


class TransformersRunner:
    """A transformers causal LM: one forward over the prompt with a fresh cache, then a forward per token."""

    def __init__(self, model, device):
        self.model, self.device, self.past = model, device, None

    def reset(self) -> None:
        self.past = None

    def _forward(self, ids: list[int]):
        import torch

        with torch.inference_mode():
            out = self.model(torch.tensor([ids], device=self.device), past_key_values=self.past, use_cache=True)
        self.past = out.past_key_values
        return out.logits[0, -1]  # (V,)

    def prefill(self, ids: list[int]):
        self.past = None
        return self._forward(ids)

    def decode(self, token: int):
        return self._forward([token])

    def argmax(self, logits) -> int:
        return int(logits.argmax())

    def sync(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.model = self.past = None


def hf_config(cfg) -> dict:
    """A transformers config (as keyword arguments, with its `model_type`) for a ModelConfig: random-weight shapes
    have no file."""
    from llmrun.models import config_to_hf

    kw = config_to_hf(cfg)
    del kw["architectures"]
    return kw


def _quiet_progress_bars():
    """transformers draws tqdm bars on stderr while it expands GGUF tensors: keep them off llmrun's stderr."""
    return redirect_stderr(io.StringIO())


def _start_transformers(files, settings):
    try:
        import transformers
    except ImportError:
        raise PeerSkipped("transformers not installed (pip install transformers)") from None
    import torch

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    from llmrun.loading import resolve_dtype

    device = torch.device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    source = files.source
    try:
        with _quiet_progress_bars():
            if source.format == "random":
                config = transformers.AutoConfig.for_model(**hf_config(files.config))
                with torch.device(device):
                    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
                what = "random weights"
            elif source.format == "gguf":  # transformers expands GGUF blocks to `dtype` as it loads them
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    str(source.path.parent), gguf_file=source.path.name, dtype=dtype).to(device)
                what = "GGUF expanded"
            else:
                model = transformers.AutoModelForCausalLM.from_pretrained(str(source.path), dtype=dtype).to(device)
                what = "safetensors"
    except Exception as e:  # a third-party engine's failure: reported, never fatal
        raise PeerSkipped(f"transformers failed to load the model: {_one_line(e)}", transformers.__version__) from None
    model.eval()
    config = f"{what} to {settings.dtype}, eager PyTorch"
    return TransformersRunner(model, device), transformers.__version__, config
