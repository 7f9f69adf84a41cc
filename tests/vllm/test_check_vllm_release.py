"""scripts/check_vllm_release.py: the installed vLLM passes (statically, and live for its CPU rows and the plugin's
registration), and a tiny synthetic release missing a method, or with a signature changed, fails (no download)."""

import importlib.util
import subprocess
import sys
from pathlib import Path
from textwrap import dedent

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_vllm_release.py"
_spec = importlib.util.spec_from_file_location("check_vllm_release", SCRIPT)
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)

INSTALLED = importlib.util.find_spec("vllm")
needs_vllm = pytest.mark.skipif(INSTALLED is None, reason="vLLM is not installed")

BACKEND = '''
class AttentionImpl:
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        raise NotImplementedError
'''
CPU_ATTN = '''
from vllm.v1.attention.backend import AttentionImpl


class CPUAttentionBackendImpl(AttentionImpl):
    def __init__(self, num_heads, head_size, scale):
        self.num_heads = num_heads

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        num_blocks, num_kv_heads, block_size, _ = kv_cache.size()
'''


def tiny_release(root: Path, cpu_attn: str = CPU_ATTN) -> Path:
    """A vLLM source tree with only the base impl and the CPU impl (`cpu_attn`: the latter's source)."""
    files = {"vllm/__init__.py": "", "vllm/v1/__init__.py": "", "vllm/v1/attention/__init__.py": "",
             "vllm/v1/attention/backend.py": BACKEND, "vllm/v1/attention/backends/__init__.py": "",
             "vllm/v1/attention/backends/cpu_attn.py": cpu_attn}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(dedent(text))
    return root


def run_script(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


@needs_vllm
def test_the_installed_release_meets_every_requirement_statically():
    lines = []
    assert check.run(Path(INSTALLED.origin).parents[1], live=False, out=lines.append) == 0, "\n".join(lines)
    assert len(lines) == len(check.REQUIREMENTS) + 2 and lines[-1] == "all requirements met"
    assert all(line.startswith("OK ") for line in lines[1:-1])


def test_a_release_without_a_method_the_plugin_overrides_fails(tmp_path):
    source = CPU_ATTN.replace("def do_kv_cache_update", "def write_kv_cache")
    result = run_script(str(tiny_release(tmp_path, source)), "--only", "CPUAttentionBackendImpl.do_kv_cache_update")
    assert result.returncode == 1, result.stdout + result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("MISSING  override"))
    assert "CPUAttentionBackendImpl.do_kv_cache_update" in line and "[vllm/cpu_attention.py]" in line
    assert "do_kv_cache_update of CPUAttentionBackendImpl" in line
    assert result.stdout.splitlines()[-1] == "3 requirement(s) not met"


def test_changed_signatures_fall_backs_and_inherited_methods(tmp_path):
    source = CPU_ATTN.replace("slot_mapping)", "slot_mapping, layer_index)")
    (tiny_release(tmp_path, source) / "vllm" / "_custom_ops.py").write_text("def op(a, b=1):\n    pass\n")
    N, CPU = check.Need, "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl"
    needs = [N("override", f"{CPU}.forward", check.FORWARD, "inherited"),
             N("override", f"{CPU}.do_kv_cache_update", check.KV_UPDATE, "changed"),
             N("call", "vllm._cpu_ops:op | vllm._custom_ops:op", "(1, b=2)", "the older home"),
             N("call", "vllm._custom_ops:op", "(1, c=2)", "no such keyword"),
             N("attrs", CPU, "num_heads head_size", "one missing"),
             N("source", f"{CPU}.do_kv_cache_update", "num_blocks, num_kv_heads, block_size, _ = kv_cache.size()",
               "layout")]
    lines = []
    assert check.run(tmp_path, live=False, requirements=needs, out=lines.append) == 1
    status = {line.rsplit("[", 1)[1].rstrip("]"): line.split()[0] for line in lines[1:-1]}
    assert status == {"inherited": "OK", "changed": "CHANGED", "the older home": "OK", "no such keyword": "CHANGED",
                      "one missing": "MISSING", "layout": "OK"}
    assert "-> (layer, key, value, kv_cache, slot_mapping, layer_index)" in lines[2]
    assert "at vllm._custom_ops" in lines[3] and lines[5].endswith("CPUAttentionBackendImpl  head_size  [one missing]")


def test_a_path_without_vllm_is_a_usage_error(tmp_path):
    result = run_script(str(tmp_path))
    assert result.returncode == 2 and "holds no vllm package" in result.stderr


@needs_vllm
def test_the_installed_release_live_with_the_plugin_registered():
    result = run_script("--only", "cpu_attn")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "(static and live check)" in lines[0] and lines[-1] == "all requirements met"
    assert any(line.startswith("OK       plugin   CPU_ATTN resolves to Sparrow's CPU backend") for line in lines)
    assert any(line.startswith("OK       plugin   wrap(TRITON_ATTN)") for line in lines)


@needs_vllm
def test_a_cuda_build_without_a_gpu_registers_the_plugin_on_a_cuda_stand_in(monkeypatch):
    """vLLM's CUDA release imports without a GPU but resolves no platform (UnspecifiedPlatform): the live check
    stands CUDA in for it, so the plugin registers its CUDA wrappers, and vLLM's own platform is back afterwards."""
    import vllm.platforms
    from vllm.platforms.interface import UnspecifiedPlatform

    monkeypatch.delenv("SPARROW_VLLM_SCHEDULE", raising=False)
    real = vllm.platforms.current_platform
    vllm.platforms.current_platform = UnspecifiedPlatform()
    try:
        results = dict(check.live_plugin())
        assert "current_platform" not in vars(vllm.platforms)  # the stand-in and the unspecified one are gone
    finally:
        vars(vllm.platforms).pop("current_platform", None)
    assert vllm.platforms.current_platform is real
    register = results["register() under SPARROW_VLLM_SCHEDULE=const:256"]
    assert (register.status, register.detail) == ("OK", "platform cuda (stood in for: no GPU here)")
    assert "CPU_ATTN resolves to Sparrow's CPU backend" not in results  # the CUDA path, not the CPU one
    assert results["wrap(TRITON_ATTN): vLLM's class, its builder and impl subclassed"].status == "OK"
    stand_in = check._cuda_stand_in(UnspecifiedPlatform())
    assert stand_in.is_cuda() and not stand_in.is_cpu() and isinstance(stand_in, UnspecifiedPlatform)


def test_a_live_import_that_fails_outside_vllm_leaves_the_row_static(tmp_path, monkeypatch):
    """A CUDA release next to a CPU torch: flashinfer's import raises AssertionError ("Torch not compiled with CUDA
    enabled"); that row keeps its static verdict, marked SKIP, instead of stopping the check."""
    (tmp_path / "needs_a_gpu.py").write_text("raise AssertionError('Torch not compiled with CUDA enabled')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    result = check.live_check(check.Need("class", "needs_a_gpu:Backend", "", "test"))
    assert result.status == "SKIP" and "AssertionError: Torch not compiled with CUDA enabled" in result.detail
    missing = check.live_check(check.Need("class", "vllm_not_a_module_here:Backend", "", "test"))
    assert missing.status == "OK" and "static only" in missing.detail  # an import error outside vllm, as before
