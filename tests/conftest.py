import os

import pytest

# Triton kernels run under the interpreter when there is no GPU; it must be set before any kernel imports.
try:
    import torch

    _cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests never reach a model hub.
os.environ["HF_HUB_OFFLINE"] = "1"


def pytest_collection_modifyitems(config, items):
    if _cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def embedded_path():
    from llmrun.loading import embedded_model_path

    return embedded_model_path()


@pytest.fixture(scope="session")
def smollm2():
    """The embedded model, loaded once in fp32 on CPU (the reference precision)."""
    from llmrun.loading import load_model

    return load_model("smollm2", device="cpu", dtype="fp32")
