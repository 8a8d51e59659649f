"""kernels/ and models/ install as llmrun.kernels / llmrun.models, in editable and wheel installs alike."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_editable_install_maps_the_subpackages():
    import llmrun.kernels
    import llmrun.models

    assert Path(llmrun.kernels.__file__).parent == ROOT / "kernels"
    assert Path(llmrun.models.__file__).parent == ROOT / "models"
    code = "import importlib.util as u; print(u.find_spec('kernels'), u.find_spec('models'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/").stdout
    assert out.strip() == "None None"  # no top-level `kernels` or `models` module


@pytest.mark.slow
def test_wheel_holds_llmrun_kernels_and_models_only_under_llmrun(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True,
    )
    (wheel,) = tmp_path.glob("llmrun-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"llmrun"}
    assert "llmrun/kernels/ref.py" in names and "llmrun/models/llama.py" in names and "llmrun/cli/chat.py" in names
    assert "llmrun/kernels/cpu_kernels.c" in names
