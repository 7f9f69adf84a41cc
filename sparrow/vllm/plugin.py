"""The vLLM plugin entry point: active only when SPARROW_VLLM_SCHEDULE is set (env.py).

vLLM runs general plugins in every process it starts (the API server, the engine core, each worker), so this
reads the environment, refuses a bad configuration with one message, and registers Sparrow's attention backend
over the one vLLM picks for the platform: CPU_ATTN on CPU; on CUDA a wrapper (wrapped.py) over each backend vLLM
may pick for decoder attention (FlashAttention; FlashInfer on Blackwell; Triton as fallback). Each wrapper
validates as the backend it wraps, so vLLM's priority order picks the backend it would have picked, and nothing
has to be passed to `LLM(...)`. The CUDA path has not run on a GPU yet (scripts/device_check.py checks
it); scripts/check_vllm_release.py checks a vLLM release against what the plugin relies on.
"""

from __future__ import annotations

from .env import from_environment
from .state import activate

CPU_BACKEND = "sparrow.vllm.cpu_attention.SparrowCPUAttentionBackend"


def register() -> None:
    config = from_environment()
    activate(config)
    if config is None:
        return
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from sparrow.errors import SparrowError

    if current_platform.is_cpu():
        from .cpu_fixes import fix_expand_kernel

        register_backend(AttentionBackendEnum.CPU_ATTN, CPU_BACKEND)
        fix_expand_kernel()  # exact mode's rejection sampler needs it (cpu_fixes.py)
    elif current_platform.is_cuda():
        from .wrapped import WRAPPED, wrapper_path

        for member in WRAPPED:
            register_backend(AttentionBackendEnum[member], wrapper_path(member))
    else:
        raise SparrowError(f"Sparrow's vLLM plugin supports CPU and CUDA, not {current_platform.device_name!r}; "
                           "unset SPARROW_VLLM_SCHEDULE to run stock vLLM")
