import importlib.util
import os
import sys
from pathlib import Path

import pytest

# Triton kernels run under the interpreter when there is no GPU; it must be set before any kernel imports.
try:
    import torch

    _cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _fused_fma():
    """The interpreter's tl.fma rounds x * y before adding z (numpy has no FMA); a GPU's FFMA rounds once, and the
    GEMV's dequantization (`triton_quant_matmul._code_weights`) is exact only so. x * y + z in float64 is exact for
    16-bit operands and rounds fp32 ones once in all but double-rounding ties, then once more to the dtype."""
    import numpy as np
    from triton.runtime import interpreter

    def create_fma(self, x, y, z):
        fused = x.data.astype(np.float64) * y.data.astype(np.float64) + z.data.astype(np.float64)
        return interpreter.TensorHandle(fused.astype(z.data.dtype), z.dtype.scalar)

    interpreter.InterpreterBuilder.create_fma = create_fma


if not _cuda:
    _fused_fma()

# Under pytest-xdist (the README's `-n auto`) the workers share the cores: each takes its share of PyTorch's threads,
# and so do the llmrun processes the tests start (OMP_NUM_THREADS, inherited): two threads a core stall PyTorch's
# parallel regions on a descheduled thread (a CLI test took 56 s instead of 5).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(_share)
    os.environ["OMP_NUM_THREADS"] = str(_share)


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker a core, but at most 4 (each loads its own models)."""
    return max(1, min(len(os.sched_getaffinity(0)), 4))


# Tests never reach a model hub.
os.environ["HF_HUB_OFFLINE"] = "1"
# Nor does the thread governor (llmrun/threads.py) run in them: it judges the CPU busy by the forwards it times, and
# a count it lowered would stay PyTorch's for the tests after. Its tests build governors of their own.
os.environ.setdefault("LLMRUN_ADAPT_THREADS", "0")


@pytest.fixture(autouse=True)
def _threads_given_back():
    """PyTorch's thread count as each test found it: an in-process `--threads 1` (the CLI's, for its process) left
    the rest of a session on one thread, AWQ's fixture at 163 s where it takes 87."""
    import torch

    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


_EMBEDDED_FIXTURES = {"embedded_path", "smollm2", "smollm2_dequant"}


# The files that take longest, run first: under the README's `-n auto --dist loadfile` one of them taken up last
# would run alone at the end while the other workers idle (the sm_80/89/90 compile sweep takes ~4 minutes).
LONGEST_FILES = ("test_triton_compile.py", "test_quantize.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in LONGEST_FILES)  # (stable: each file's order stays)
    for item in items:  # bench/gpu.sh selects by it: a lent GPU has the embedded model in one call of two
        if _EMBEDDED_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.embedded)
    if _cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """LLMRUN_TEST_FAILURES_AT_ONCE=1 (bench/gpu.sh): a failure's report goes to stderr as the test ends, not only
    in the summary at the end of the run, which a lease's time limit cuts off (an H100's 30 failures came back
    without one traceback, 2026-11-27). Under pytest-xdist the controller prints each worker's reports."""
    if (report.failed and os.environ.get("LLMRUN_TEST_FAILURES_AT_ONCE") == "1"
            and "PYTEST_XDIST_WORKER" not in os.environ):  # (a worker's own print would reach the terminal too)
        text = report.longreprtext
        if len(text) > 4000:
            text = text[:1000] + "\n...\n" + text[-3000:]
        print(f"\n--- FAILED {report.nodeid} ({report.when})\n{text}\n---", file=sys.stderr, flush=True)


# A launch config the split attention kernel and the GEMVs each take on CUDA under LLMRUN_TEST_ONE_CONFIG=1: the
# split kernel's least shared memory (it fits every GPU Triton supports), and the GEMVs' smallest tiles.
ONE_SPLIT_CONFIG = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
ONE_GEMV_CONFIG = {"BLOCK_N": 32, "BLOCK_K": 64, "STAGES": 4, "num_warps": 4}
ONE_DOT_CONFIG = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}


@pytest.fixture(autouse=True)
def _one_config(request, monkeypatch):
    """LLMRUN_TEST_ONE_CONFIG=1 on CUDA: the autotuned kernels run one fixed config instead of timing all of theirs
    for every new key (bench/gpu.sh sets it for the test files, whose hundreds of shapes would otherwise spend a
    GPU lease compiling and timing configs: through the autotuners the model files never ran to their end in
    one). Each config is still checked against the reference by the tests that pin one config after another
    (`test_every_split_config`, `test_every_gemv_config`, `test_every_dot_config`, marked `autotune`), and that a
    kernel's launches share one autotuner key whatever the rows or the step by the tests that record them."""
    if not (_cuda and os.environ.get("LLMRUN_TEST_ONE_CONFIG") == "1") or "autotune" in request.keywords:
        return
    from llmrun.kernels import decode_attention, triton_quant_matmul

    for module, name, kernel, config in ((decode_attention, "_split_launcher", "_split_kernel", ONE_SPLIT_CONFIG),
                                         (triton_quant_matmul, "_gemv_launcher", "_gemv_kernel", ONE_GEMV_CONFIG),
                                         (triton_quant_matmul, "_dot_launcher", "_gemv_dot_kernel", ONE_DOT_CONFIG)):
        launcher, fixed = getattr(module, name), (getattr(module, kernel), config)
        monkeypatch.setattr(module, name,
                            lambda cuda, launcher=launcher, fixed=fixed: fixed if cuda else launcher(cuda))


@pytest.fixture
def row_by_row_dot(monkeypatch):
    """Under the interpreter, tl.dot computes each row of its product on its own. The interpreter's np.matmul gives
    a row other bits depending on where in the tile it sits, as a GPU's MMA does not: without this, the bits of a
    row would say more about numpy's BLAS than about the kernel. On a GPU the tests run as they are."""
    if _cuda:
        return
    import numpy as np
    from triton.runtime import interpreter

    whole = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, *args):
        rows = [whole(self, interpreter.TensorHandle(a.data[i : i + 1], a.dtype), b,
                      interpreter.TensorHandle(d.data[i : i + 1], d.dtype), *args) for i in range(a.data.shape[0])]
        return interpreter.TensorHandle(np.concatenate([r.data for r in rows]), rows[0].dtype)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


@pytest.fixture(scope="session", autouse=True)
def _own_quantized_index(tmp_path_factory):
    """`llmrun quantize` records what it writes for `llmrun models`: tests record into an index of their own, never
    the user's."""
    import llmrun.catalog

    path = tmp_path_factory.mktemp("llmrun-cache") / "quantized.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llmrun.catalog, "quantized_index_path", lambda: path)
        yield path


@pytest.fixture(scope="session")
def embedded_path():
    from llmrun.loading import embedded_model_path

    return embedded_model_path()


@pytest.fixture(scope="session")
def smollm2():
    """The embedded model as llmrun runs it on a CPU by default: Q4_1/Q8_0 weights packed, fp32 activations."""
    from llmrun.loading import load_model

    return load_model("smollm2", device="cpu", dtype="fp32")


@pytest.fixture(scope="session")
def smollm2_dequant():
    """The embedded model with every weight dequantized to fp32: plain PyTorch, the exact reference."""
    from llmrun.loading import load_model

    return load_model("smollm2", device="cpu", dtype="fp32", weights="dequant")


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """A tiny target and a different tiny draft (other weights, one layer) with the same vocabulary."""
    import dataclasses

    from llmrun.loading import load_model

    from .tiny import CONFIGS, random_model, write_hf_dir

    root = tmp_path_factory.mktemp("pair")
    cfg = CONFIGS["llama"]
    target = write_hf_dir(root / "target", random_model(cfg, seed=0))
    draft = write_hf_dir(root / "draft", random_model(dataclasses.replace(cfg, n_layers=1), seed=7))
    return load_model(str(target), "cpu", "fp32"), load_model(str(draft), "cpu", "fp32")


def run_main(args, monkeypatch, capsys, cwd=None, stdin: str = "") -> tuple[int, str, str]:
    """`llmrun ARGS` through the entry point, in-process, with `stdin` (a pipe) -> (exit code, stdout, stderr).
    An exception escaping `main()` is written to stderr as the interpreter would (a traceback, exit code 1)."""
    import io
    import sys
    import traceback

    from llmrun.cli import main

    if cwd is not None:
        monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["llmrun", *map(str, args)])
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    capsys.readouterr()
    code, escaped = 0, ""
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception as e:  # what would end the process with a traceback
        code, escaped = 1, "".join(traceback.format_exception(e))
    out, err = capsys.readouterr()
    return code, out, err + escaped


@pytest.fixture
def bench_script(monkeypatch):
    """load(NAME) -> bench/NAME.py imported as when it runs as a script: bench/ on sys.path (its imports of the
    scripts beside it) and the module registered under its name (dataclasses look their module up there)."""
    folder = Path(__file__).resolve().parent.parent / "bench"
    monkeypatch.syspath_prepend(str(folder))

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"bench_{name}", folder / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, module)
        spec.loader.exec_module(module)
        return module

    return load
