"""The wheel carries what the package needs at run time: the presets, the CPU kernel's sources, so that an
installed (not editable) package builds its kernel where a compiler exists, and every file of the code reward's
harness, a directory the sandbox runs by its __main__.py."""

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the package's sources (the build leaves its build/ there, not in the checkout)."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "sparrow", source / "sparrow", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(work / "dist"), str(source)], check=True, timeout=300, capture_output=True)
    (built,) = (work / "dist").glob("sparrow_rl-*.whl")
    return built


def test_the_wheel_carries_the_kernel_sources_and_the_presets(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {f"sparrow/cpu/csrc/{p.name}" for p in (ROOT / "sparrow/cpu/csrc").iterdir()
               if p.suffix in (".cpp", ".h")}
    assert {"sparrow/cpu/csrc/sparse_decode.cpp", "sparrow/cpu/csrc/small_linear.cpp"} <= sources
    assert sources <= names
    assert "sparrow/data/sparrow_schedules.json" in names


def test_the_wheel_carries_the_code_reward_harness(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    harness = {f"sparrow/rewards/harness/{p.name}" for p in (ROOT / "sparrow/rewards/harness").glob("*.py")}
    assert {"sparrow/rewards/harness/__main__.py", "sparrow/rewards/harness/judge.py"} <= harness <= names


def test_a_missing_source_is_one_line_saying_so(monkeypatch, tmp_path):
    from sparrow.cpu import kernel as cpu_kernel

    monkeypatch.setattr(cpu_kernel, "_SOURCES", [tmp_path / "csrc" / "sparse_decode.cpp"])
    assert cpu_kernel.cannot_build() == (f"the installed package lacks its kernel sources sparse_decode.cpp in "
                                         f"{tmp_path / 'csrc'}; reinstall sparrow-rl from a wheel or checkout that "
                                         "has them")
    monkeypatch.setattr(cpu_kernel, "_SOURCES", [ROOT / "sparrow/cpu/csrc/sparse_decode.cpp"])
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert cpu_kernel.cannot_build() == ("no C++ compiler: 'no-such-compiler' is not on PATH (install g++, or set "
                                         "CXX to one)")


STEP = textwrap.dedent("""
    import warnings
    warnings.simplefilter("error")
    import torch
    import sparrow
    from sparrow.attention import SparseConfig
    from sparrow.cpu import kernel as cpu_kernel
    print(sparrow.__file__)
    assert cpu_kernel.load() is not None
    torch.manual_seed(0)
    sparse, page, dim = SparseConfig(page_size=16), 16, 32
    keys, values = torch.randn(1, 2, 6, page, dim), torch.randn(1, 2, 6, page, dim)
    queries, total = torch.randn(1, 2, 3, dim), torch.tensor([6 * page])
    got = cpu_kernel.sparse_decode(queries, keys, values, sparse.page_landmark.build(keys), torch.tensor([6]),
                                   torch.tensor([6]), total, sparse, 0.2)
    weights = torch.softmax(0.2 * queries @ keys.flatten(2, 3).transpose(-1, -2), dim=-1)
    assert torch.allclose(got, weights @ values.flatten(2, 3), atol=1e-5)
    print("compiled step ok")
""")


@pytest.mark.slow
def test_an_installed_wheel_builds_its_kernel_and_decodes(wheel, tmp_path):
    """A fresh virtual environment sees this one's packages (torch and the rest, nothing downloaded) through a .pth
    line, not its editable install of the checkout; the wheel installed there builds the kernel and runs a step."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler here")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                          capture_output=True, text=True).stdout.strip()
    Path(site, "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                    "-q", str(wheel)], check=True, timeout=300)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"), "PYTHONPATH": ""}
    env.pop("SPARROW_CPU_KERNEL", None)
    done = subprocess.run([python, "-c", STEP], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(site) and lines[-1] == "compiled step ok", done.stdout
