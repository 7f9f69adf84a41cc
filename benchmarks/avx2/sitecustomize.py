"""Makes every Python process started under benchmarks/avx2/run.sh see an AVX2-only x86 CPU: torch's vector
paths (ATEN_CPU_CAPABILITY), oneDNN and MKL are capped by run.sh, and the CPU queries that vLLM's CPU build reads
to pick its kernels (_C_AVX2, its attention ISA, bf16 paths) answer False here, set when torch.cpu is imported
(nothing is imported ahead of the program)."""
import importlib.abc
import importlib.machinery
import sys

_QUERIES = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported",
            "_is_amx_fp16_supported", "_is_avx512_vnni_supported")


class _CapTorchCpu(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch.cpu":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                for query in _QUERIES:
                    if hasattr(module, query):
                        setattr(module, query, lambda: False)

            spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _CapTorchCpu())
