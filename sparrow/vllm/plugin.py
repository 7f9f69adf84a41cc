"""The vLLM plugin entry point: active only when SPARROW_VLLM_SCHEDULE is set (config.py).

vLLM runs general plugins in every process it starts (the API server, the engine core, each worker), so this
reads the environment, refuses a bad configuration with one message, and registers Sparrow's attention backend
over vLLM's own for the platform.
"""

from __future__ import annotations

from .config import activate, from_environment

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
        register_backend(AttentionBackendEnum.CPU_ATTN, CPU_BACKEND)
    else:
        raise SparrowError(f"Sparrow's vLLM plugin supports the CPU platform here, not "
                           f"{current_platform.device_name!r}; unset SPARROW_VLLM_SCHEDULE to run stock vLLM")
