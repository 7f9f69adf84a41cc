"""Check a vLLM release against everything Sparrow's vLLM plugin relies on, before users install it.

    .venv/bin/python scripts/check_vllm_release.py              # the vLLM installed here: static and live
    .venv/bin/python scripts/check_vllm_release.py 0.34.0       # pip download vllm==0.34.0 --no-deps, static
    .venv/bin/python scripts/check_vllm_release.py PATH         # a wheel, an unpacked wheel or a source tree

The static check needs no install: it parses the release's Python source with `ast` and finds each module, class,
method, enum member and attribute in REQUIREMENTS (classes through their bases across modules, names through imports
and re-exports), compares the signatures the plugin overrides or calls, the enum values it orders by, and a few lines
of source that fix the KV-cache layout it reads. Where the release is the installed one it also checks the same table
live (importlib, inspect.signature), imports the plugin, registers it and resolves the backends it registered. The
CUDA release imports on a machine without a GPU (in an environment of its own: `pip install vllm==X` brings its CUDA
torch), where vLLM resolves no platform: CUDA is then stood in for, so the plugin registers its CUDA wrappers.
One line per requirement (OK, MISSING, CHANGED with what changed; SKIP for a live step that cannot run here, the
row keeping its static verdict); exit 1 on any MISSING or CHANGED, 2 on a
bad argument. What this cannot check (kernels, runtime behaviour, CUDA) is in docs/vllm-plugin.md.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

B = "vllm.v1.attention.backend"
REG = "vllm.v1.attention.backends.registry"
CPU = "vllm.v1.attention.backends.cpu_attn"
FA = "vllm.v1.attention.backends.flash_attn"
FI = "vllm.v1.attention.backends.flashinfer"
TR = "vllm.v1.attention.backends.triton_attn"
FORWARD = "(layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None)"
KV_UPDATE = "(layer, key, value, kv_cache, slot_mapping)"
BUILDER_INIT = "(kv_cache_spec, layer_names, vllm_config, device)"
BUILD = "(common_prefix_len, common_attn_metadata, fast_build=False)"
CG_SUPPORT = "(vllm_config, kv_cache_spec)"
CUDA_LAYOUT = "kv_cache.transpose(1, 2).split(self.head_size, dim=-1)"  # [blocks, Hkv, block, 2 D] -> K, V
NO_WINDOW = "self.sliding_window = (-1, -1)"
SEPARATE_WRITE = "forward_includes_kv_cache_update=False"  # vLLM calls do_kv_cache_update, where landmarks are kept
WB, WI = "vllm/wrapped.py SparrowBuilderMixin", "vllm/wrapped.py SparrowImplMixin"
IMPL_ATTRS = ("alibi_slopes sliding_window logits_soft_cap kv_sharing_target_layer_name kv_cache_dtype head_size "
              "num_heads num_kv_heads scale")  # and attn_type, which FlashInferImpl lacks (the wrapper defaults it)
RELOAD = "(weights_iterator=w, is_checkpoint_format=True)"


class Need(NamedTuple):
    """One thing the plugin relies on. `target`: "module:Qualified.name" (alternatives separated by " | ", the
    first present one counts: the plugin's fallbacks); `spec` per kind (see `Checker`); `used`: where in sparrow."""

    kind: str
    target: str
    spec: str
    used: str


def wrapped_backend(module: str, name: str, impl_attrs: str) -> tuple[Need, ...]:
    """What wrapped.py relies on in one of vLLM's CUDA backends: `name`Backend, `name`MetadataBuilder, `name`Impl."""
    backend, builder, impl = f"{module}:{name}Backend", f"{module}:{name}MetadataBuilder", f"{module}:{name}Impl"
    return (
        Need("values", backend, SEPARATE_WRITE, "vllm/wrapped.py"),
        Need("returns", f"{backend}.get_builder_cls", f"{name}MetadataBuilder", "vllm/wrapped.py wrap"),
        Need("returns", f"{backend}.get_impl_cls", f"{name}Impl", "vllm/wrapped.py wrap"),
        Need("override", f"{builder}.__init__", BUILDER_INIT, WB),
        Need("override", f"{builder}.build", BUILD, WB),
        Need("override", f"{builder}.get_cudagraph_support", CG_SUPPORT, WB),
        Need("override", f"{impl}.forward", FORWARD, WI),
        Need("override", f"{impl}.do_kv_cache_update", KV_UPDATE, WI),
        Need("attrs", impl, impl_attrs, WI),
        Need("source", f"{impl}.__init__", NO_WINDOW, "vllm/wrapped.py (no sliding window: (-1, -1))"),
        Need("source", f"{impl}.do_kv_cache_update", CUDA_LAYOUT, "vllm/wrapped.py caches, triton_decode.py"),
    )


N = Need
REQUIREMENTS = (
    # loading and registering the plugin
    N("string", "vllm.plugins", "vllm.general_plugins", "pyproject.toml entry point"),
    N("name", "vllm.plugins:plugins_loaded", "", "integrations/trl.py configure_plugin"),
    N("name", "vllm.platforms:current_platform", "", "vllm/plugin.py register"),
    N("call", "vllm.platforms.interface:Platform.is_cpu", "()", "vllm/plugin.py, rollout/vllm_backend.py, trl_cpu.py"),
    N("call", "vllm.platforms.interface:Platform.is_cuda", "()", "vllm/plugin.py"),
    N("attrs", "vllm.platforms.interface:Platform", "device_name", "vllm/plugin.py (refusal message)"),
    N("call", f"{REG}:register_backend", "(member, 'module.Class')", "vllm/plugin.py"),
    N("backend", f"{REG}:AttentionBackendEnum.CPU_ATTN", f"{CPU}.CPUAttentionBackend", "vllm/plugin.py"),
    N("backend", f"{REG}:AttentionBackendEnum.FLASH_ATTN", f"{FA}.FlashAttentionBackend", "vllm/wrapped.py WRAPPED"),
    N("backend", f"{REG}:AttentionBackendEnum.FLASHINFER", f"{FI}.FlashInferBackend", "vllm/wrapped.py WRAPPED"),
    N("backend", f"{REG}:AttentionBackendEnum.TRITON_ATTN", f"{TR}.TritonAttentionBackend", "vllm/wrapped.py WRAPPED"),
    N("source", f"{REG}:AttentionBackendEnum.get_class", "resolve_obj_by_qualname(self.get_path())",
      "vllm/wrapped.py (overrides are resolved by path, through the module's __getattr__)"),
    N("call", "vllm.utils.import_utils:resolve_obj_by_qualname", "('module.Class')", "vllm/wrapped.py _wrapper"),
    N("source", "vllm.platforms.cpu:CpuPlatform.get_attn_backend_cls", "AttentionBackendEnum.CPU_ATTN.get_path()",
      "vllm/plugin.py (the CPU platform honours the CPU_ATTN override)"),
    N("source", "vllm.platforms.cuda:_get_attn_backend_class", "backend.get_class()",
      "vllm/plugin.py (the CUDA platform honours the overrides)"),
    N("mentions", "vllm.platforms.cuda:_get_backend_priorities",
      "FLASH_ATTN FLASHINFER TRITON_ATTN FLEX_ATTENTION TURBOQUANT TRITON_FLASH_ATTN TRITON_FLASHINFER",
      "vllm/wrapped.py WRAPPED (non-MLA decoder backends vLLM may pick on CUDA)"),
    # the backend interface
    N("values", f"{B}:AttentionCGSupport", "NEVER=0 UNIFORM_SINGLE_TOKEN_DECODE=1 UNIFORM_BATCH=2 ALWAYS=3",
      "vllm/wrapped.py get_cudagraph_support (lowest by value)"),
    N("values", f"{B}:AttentionType", "DECODER='decoder'", "vllm/cpu_attention.py, vllm/wrapped.py"),
    N("call", f"{B}:MultipleOf", "(16)", "vllm/cpu_attention.py get_supported_kernel_block_sizes"),
    N("attrs", f"{B}:CommonAttentionMetadata",
      "query_start_loc query_start_loc_cpu seq_lens seq_lens_cpu_upper_bound num_reqs max_query_len max_seq_len "
      "block_table_tensor slot_mapping causal is_prefilling mm_req_doc_ranges _num_computed_tokens_cache",
      "vllm/plan.py, vllm/wrapped.py, vllm/graph_decode.py, vllm/cpu_attention.py"),
    N("call", f"{B}:CommonAttentionMetadata.replace", "(seq_lens=s, _num_computed_tokens_cache=None)",
      "vllm/wrapped.py reduced, SparrowBuilderMixin.build"),
    N("override", f"{B}:AttentionMetadataBuilder.__init__", BUILDER_INIT, "vllm/wrapped.py, vllm/cpu_attention.py"),
    N("override", f"{B}:AttentionMetadataBuilder.build", BUILD, "vllm/wrapped.py, vllm/cpu_attention.py"),
    N("override", f"{B}:AttentionMetadataBuilder.get_cudagraph_support", CG_SUPPORT, "vllm/wrapped.py"),
    N("override", f"{B}:AttentionImpl.forward", FORWARD, "vllm/wrapped.py, vllm/cpu_attention.py"),
    N("override", f"{B}:AttentionImpl.fused_output_quant_supported", "(quant_key)", "vllm/wrapped.py"),
    N("override", f"{B}:AttentionImpl.fused_rope_kvcache_supported", "()",
      "vllm/wrapped.py (refused: a fused write would skip do_kv_cache_update)"),
    N("override", f"{B}:AttentionImpl.fused_qk_norm_rope_kvcache_supported", "()",
      "vllm/wrapped.py (refused: a fused write would skip do_kv_cache_update)"),
    # vLLM's CPU backend, subclassed (cpu_attention.py)
    N("values", f"{CPU}:CPUAttentionBackend", SEPARATE_WRITE, "vllm/cpu_attention.py"),
    N("override", f"{CPU}:CPUAttentionBackend.get_supported_kernel_block_sizes", "(kv_cache_spec=None)",
      "vllm/cpu_attention.py"),
    N("override", f"{CPU}:CPUAttentionBackend.get_impl_cls", "()", "vllm/cpu_attention.py"),
    N("override", f"{CPU}:CPUAttentionBackend.get_builder_cls", "()", "vllm/cpu_attention.py"),
    N("call", f"{CPU}:CPUAttentionBackend.get_supported_head_sizes", "()", "rollout/vllm_backend.py check_head_size"),
    N("attrs", f"{CPU}:CPUAttentionMetadata", "causal", "vllm/cpu_attention.py SparrowCPUMetadata"),
    N("override", f"{CPU}:CPUAttentionMetadataBuilder.__init__", BUILDER_INIT, "vllm/cpu_attention.py"),
    N("override", f"{CPU}:CPUAttentionMetadataBuilder.build", BUILD, "vllm/cpu_attention.py"),
    N("attrs", f"{CPU}:CPUAttentionMetadataBuilder", "is_cross_attention is_encoder_only_attention block_size "
      "kv_cache_dtype isa num_heads num_kv_heads head_dim dtype window_size", "vllm/cpu_attention.py"),
    N("call", f"{CPU}:CPUAttentionMetadataBuilder._set_isa_to_layers", "(layer_names)", "vllm/cpu_attention.py"),
    N("assigned", CPU, "isa", "vllm/cpu_attention.py (layer.isa)"),
    N("override", f"{CPU}:CPUAttentionBackendImpl.__init__",
      "(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype, "
      "logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None, sinks=None)",
      "vllm/cpu_attention.py SparrowCPUAttentionImpl"),
    N("override", f"{CPU}:CPUAttentionBackendImpl.forward", FORWARD, "vllm/cpu_attention.py"),
    N("override", f"{CPU}:CPUAttentionBackendImpl.do_kv_cache_update", KV_UPDATE, "vllm/cpu_attention.py"),
    N("attrs", f"{CPU}:CPUAttentionBackendImpl", IMPL_ATTRS + " attn_type sinks", "vllm/cpu_attention.py"),
    N("source", f"{CPU}:CPUAttentionBackendImpl.do_kv_cache_update",
      "num_blocks, num_kv_heads, block_size, _ = kv_cache.size()",
      "vllm/cpu_attention.py cpu_page_reader (cache [blocks, Hkv, block, 2 D])"),
    N("source", f"{CPU}:CPUAttentionBackendImpl.do_kv_cache_update",
      "key_cache, value_cache = kv_cache.chunk(2, dim=2)",
      "vllm/cpu_attention.py cpu_page_reader (keys, then values, per block and head)"),
    N("call", "vllm._cpu_ops:cpu_attn_get_scheduler_metadata | vllm._custom_ops:cpu_attn_get_scheduler_metadata",
      "(num_reqs=1, num_heads=1, num_kv_heads=1, head_dim=1, seq_lens=s, dtype=d, query_start_loc=q, causal=True, "
      "sliding_window_size=-1, isa='vec', enable_kv_split=True, dynamic_causal=None, kv_cache_dtype='auto')",
      "vllm/cpu_attention.py _stock_metadata"),
    N("call", "vllm._cpu_ops:cpu_attention_with_kv_cache | vllm._custom_ops:cpu_attention_with_kv_cache",
      "(query=q, key_cache=k, value_cache=v, output=o, query_start_loc=q, seq_lens=s, scale=1.0, causal=True, "
      "alibi_slopes=None, sliding_window=-1, block_table=b, softcap=0, scheduler_metadata=m, s_aux=None, "
      "dynamic_causal=None, k_scale=1.0, v_scale=1.0, kv_cache_dtype='auto')", "vllm/cpu_attention.py _stock_forward"),
    N("name", "vllm.envs:VLLM_CPU_ATTN_SPLIT_KV", "", "vllm/cpu_attention.py _stock_metadata"),
    N("assigned", "vllm.model_executor.layers.attention.attention", "_k_scale_float _v_scale_float",
      "vllm/cpu_attention.py _stock_forward"),
    # vLLM's CUDA backends, wrapped (wrapped.py)
    *wrapped_backend(FA, "FlashAttention", IMPL_ATTRS + " attn_type"),
    *wrapped_backend(FI, "FlashInfer", IMPL_ATTRS),
    *wrapped_backend(TR, "TritonAttention", IMPL_ATTRS + " attn_type"),
    N("values", "vllm.config:CUDAGraphMode", "FULL=2 FULL_DECODE_ONLY FULL_AND_PIECEWISE", "vllm/wrapped.py"),
    # engine state the plugin reads
    N("call", "vllm.forward_context:get_forward_context", "()", "vllm/cpu_attention.py _layer_metadata"),
    N("attrs", "vllm.forward_context:ForwardContext", "attn_metadata", "vllm/cpu_attention.py _layer_metadata"),
    N("call", "vllm.model_executor.models.utils:extract_layer_index", "('model.layers.0.self_attn.attn')",
      "vllm/cpu_attention.py, vllm/wrapped.py forward"),
    N("attrs", "vllm.model_executor.layers.attention:Attention", "layer_name", "vllm/cpu_attention.py, wrapped.py"),
    N("call", "vllm.v1.kv_cache_interface:is_quantized_kv_cache", "('auto')", "vllm/checks.py, vllm/wrapped.py"),
    N("attrs", "vllm.config:VllmConfig", "parallel_config model_config speculative_config compilation_config "
      "scheduler_config cache_config", "vllm/checks.py, vllm/wrapped.py, rollout/vllm_backend.py"),
    N("attrs", "vllm.config:ParallelConfig", "tensor_parallel_size decode_context_parallel_size "
      "prefill_context_parallel_size", "vllm/checks.py check_engine"),
    N("call", "vllm.config:ModelConfig.get_total_num_kv_heads", "()", "vllm/checks.py check_engine"),
    N("call", "vllm.config:ModelConfig.get_total_num_hidden_layers", "()", "vllm/cpu_attention.py, vllm/wrapped.py"),
    N("attrs", "vllm.config:ModelConfig", "max_model_len", "integrations/trl.py _sparrow_engine_length"),
    N("attrs", "vllm.config:CompilationConfig", "cudagraph_mode cudagraph_capture_sizes", "vllm/wrapped.py"),
    N("attrs", "vllm.config:SchedulerConfig", "max_num_seqs", "vllm/wrapped.py graph_buffers"),
    N("attrs", "vllm.config:CacheConfig", "num_gpu_blocks block_size", "rollout/vllm_backend.py _warn_if_preemptible"),
    # the engine as VLLMBackend and the TRL integration drive it
    N("class", "vllm:LLM", "", "rollout/vllm_backend.py, integrations/trl_cpu.py"),
    N("attrs", "vllm.engine.arg_utils:EngineArgs", "model dtype enforce_eager max_model_len logprobs_mode "
      "max_logprobs seed enable_prefix_caching block_size", "rollout/vllm_backend.py LLM(...)"),
    N("string", "vllm.config.model", "processed_logprobs", "rollout/vllm_backend.py logprobs_mode"),
    N("call", "vllm:LLM.generate", "(prompts, params, use_tqdm=False)", "rollout/vllm_backend.py generate"),
    N("call", "vllm:LLM.collective_rpc", "('reload_weights', kwargs={})", "vllm/weights.py reload"),
    N("call", "vllm:LLM.reset_prefix_cache", "()", "rollout/vllm_backend.py, integrations/trl_cpu.py"),
    N("attrs", "vllm:LLM", "llm_engine", "rollout/vllm_backend.py, integrations/trl.py"),
    N("attrs", "vllm.v1.engine.llm_engine:LLMEngine", "vllm_config model_config",
      "rollout/vllm_backend.py, integrations/trl.py"),
    N("attrs", "vllm:SamplingParams", "n temperature top_p top_k max_tokens stop ignore_eos logprobs seed",
      "rollout/vllm_backend.py generate"),
    N("attrs", "vllm.outputs:RequestOutput", "outputs", "rollout/vllm_backend.py generate"),
    N("attrs", "vllm.outputs:CompletionOutput", "token_ids logprobs finish_reason", "rollout/vllm_backend.py _fill"),
    N("attrs", "vllm.logprobs:Logprob", "logprob rank", "rollout/vllm_backend.py _fill"),
    N("call", "vllm.v1.worker.gpu_worker:Worker.reload_weights", RELOAD, "vllm/weights.py reload (collective_rpc)"),
    N("call", "vllm.v1.worker.gpu.model_runner:GPUModelRunner.reload_weights", RELOAD,
      "vllm/weights.py reload (model runner V2)"),
    N("call", "vllm.v1.worker.gpu_model_runner:GPUModelRunner.reload_weights | "
      "vllm.v1.worker.gpu.model_runner:GPUModelRunner.reload_weights", RELOAD,
      "vllm/weights.py reload (model runner V1; 0.34 has V2 only)"),
    N("call", "vllm.v1.worker.cpu.model_runner:CPUModelRunner.reload_weights | "
      "vllm.v1.worker.cpu_model_runner:CPUModelRunner.reload_weights", RELOAD,
      "vllm/weights.py reload (the CPU worker's runner: V2-based from 0.34)"),
    N("string", "vllm.model_executor.model_loader.reload.layerwise", "%s: Failed to load weights",
      "vllm/weights.py RELOAD_LOGGER, FAILED_LOAD"),
)


class Result(NamedTuple):
    status: str  # OK, MISSING, CHANGED, SKIP
    detail: str = ""


def ok(detail: str = "") -> Result:
    return Result("OK", detail)


# -- reading the release's source ---------------------------------------------------------------------------------


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> list[tuple[str, str, bool]]:
    """(name, kind, has default) of each parameter, without self/cls of a method (not of a staticmethod)."""
    a = fn.args
    positional = [(p.arg, "positional-only") for p in a.posonlyargs] + [(p.arg, "positional") for p in a.args]
    defaults = [False] * (len(positional) - len(a.defaults)) + [True] * len(a.defaults)
    out = [(n, k, d) for (n, k), d in zip(positional, defaults)]
    if a.vararg:
        out.append((a.vararg.arg, "var-positional", False))
    out += [(p.arg, "keyword-only", d is not None) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append((a.kwarg.arg, "var-keyword", False))
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
    return out[1:] if method and not static and out and out[0][1].startswith("positional") else out


def _spec_params(spec: str) -> list[tuple[str, str, bool]]:
    return _params(ast.parse(f"def f{spec}: pass").body[0], method=False)


_KINDS = {"positional-only": inspect.Parameter.POSITIONAL_ONLY, "positional": inspect.Parameter.POSITIONAL_OR_KEYWORD,
          "var-positional": inspect.Parameter.VAR_POSITIONAL, "keyword-only": inspect.Parameter.KEYWORD_ONLY,
          "var-keyword": inspect.Parameter.VAR_KEYWORD}


def _live_params(sig: inspect.Signature) -> list[tuple[str, str, bool]]:
    label = {kind: name for name, kind in _KINDS.items()}
    return [(p.name, label[p.kind], p.default is not p.empty) for p in sig.parameters.values()]


def _show(params: list[tuple[str, str, bool]]) -> str:
    parts, star = [], False
    for name, kind, default in params:
        if kind == "keyword-only" and not star:
            parts.append("*")
        star = star or kind in ("keyword-only", "var-positional")
        prefix = {"var-positional": "*", "var-keyword": "**"}.get(kind, "")
        parts.append(f"{prefix}{name}{'=' if default else ''}")
    return "(" + ", ".join(parts) + ")"


def compare_override(expected: str, found: list[tuple[str, str, bool]]) -> Result:
    """The plugin overrides this method: vLLM calls the override as it calls its own, so names and kinds must
    match (a default added or dropped is shown but accepted)."""
    want = _spec_params(expected)
    if [(n, k) for n, k, _ in want] == [(n, k) for n, k, _ in found]:
        return ok()
    return Result("CHANGED", f"parameters {_show(want)} -> {_show(found)}")


def compare_call(call: str, found: list[tuple[str, str, bool]]) -> Result:
    """The plugin calls it with these arguments: they must still bind."""
    node = ast.parse("f" + call, mode="eval").body
    params = [inspect.Parameter(n, _KINDS[k], default=None if d else inspect.Parameter.empty) for n, k, d in found]
    try:
        inspect.Signature(params).bind(*range(len(node.args)), **{k.arg: 0 for k in node.keywords})
    except TypeError as err:
        return Result("CHANGED", f"the plugin's call {call} no longer binds to {_show(found)}: {err}")
    return ok()


def _targets(node: ast.AST) -> list[ast.expr]:
    """What an assignment statement assigns to (nothing for other nodes)."""
    if isinstance(node, ast.Assign):
        return node.targets
    return [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []


class Imported(NamedTuple):
    """A top-level `import` or `from ... import` binding a name (`alias` is the ast.alias)."""

    statement: ast.Import | ast.ImportFrom
    alias: ast.alias


class Found(NamedTuple):
    kind: str  # module, class, function, value, lazy; for members: method, class attribute, instance attribute
    module: str
    node: ast.AST | None


class Source:
    """A vLLM release's source tree (the directory holding `vllm/`), parsed module by module on demand."""

    def __init__(self, root: Path):
        self.root = root
        self._trees: dict[str, ast.Module | None] = {}

    def file(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            path = self.file(module)
            self._trees[module] = None if path is None else ast.parse(path.read_text(encoding="utf-8"))
        return self._trees[module]

    def bindings(self, module: str) -> dict[str, ast.AST | Imported]:
        """Top-level names of `module` (also those bound under if/try, e.g. TYPE_CHECKING imports): definitions
        first, then assignments, then imports."""
        found: dict[str, list[tuple[int, ast.AST]]] = {}

        def visit(statements):
            for st in statements:
                if isinstance(st, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    found.setdefault(st.name, []).append((0, st))
                elif isinstance(st, ast.Assign):
                    for t in st.targets:
                        if isinstance(t, ast.Name):
                            found.setdefault(t.id, []).append((1, st))
                elif isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                    found.setdefault(st.target.id, []).append((1, st))
                elif isinstance(st, (ast.Import, ast.ImportFrom)):
                    for alias in st.names:
                        name = alias.asname or alias.name.split(".")[0]
                        found.setdefault(name, []).append((2, Imported(st, alias)))
                elif isinstance(st, (ast.If, ast.Try)):
                    visit(st.body)
                    visit(getattr(st, "orelse", []))
                    for handler in getattr(st, "handlers", []):
                        visit(handler.body)

        tree = self.tree(module)
        visit(tree.body if tree else [])
        return {name: min(entries, key=lambda e: e[0])[1] for name, entries in found.items()}

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        package = module if self.file(module).name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        return f"{package}.{node.module}" if node.module else package

    def resolve(self, module: str, name: str, depth: int = 0) -> Found | None:
        """What `name` is in `module`, through imports, re-exports and aliases."""
        if depth > 20 or self.tree(module) is None:
            return None
        node = self.bindings(module).get(name)
        if node is None:
            if self.file(f"{module}.{name}"):
                return Found("module", f"{module}.{name}", None)
            lazy = self.bindings(module).get("__getattr__")
            if lazy is not None and any(isinstance(c, ast.Constant) and c.value == name for c in ast.walk(lazy)):
                return Found("lazy", module, lazy)
            return None
        if isinstance(node, ast.ClassDef):
            return Found("class", module, node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return Found("function", module, node)
        if isinstance(node, Imported):
            st, original = node.statement, node.alias.name
            if isinstance(st, ast.Import):
                return Found("module", original if node.alias.asname else original.split(".")[0], None)
            source = self._absolute(module, st)
            if self.file(f"{source}.{original}"):
                return Found("module", f"{source}.{original}", None)
            return self.resolve(source, original, depth + 1)
        value = getattr(node, "value", None)
        if isinstance(value, (ast.Name, ast.Attribute)):
            target = self.expression(module, value, depth + 1)
            if target is not None:
                return target
        return Found("value", module, node)

    def expression(self, module: str, expr: ast.expr, depth: int = 0) -> Found | None:
        """What a name or dotted expression (a base class, an alias) in `module` refers to."""
        if isinstance(expr, ast.Subscript):
            return self.expression(module, expr.value, depth)
        if isinstance(expr, ast.Name):
            return self.resolve(module, expr.id, depth)
        if isinstance(expr, ast.Attribute):
            owner = self.expression(module, expr.value, depth)
            if owner is not None and owner.kind == "module":
                return self.resolve(owner.module, expr.attr, depth)
        return None

    def mro(self, found: Found) -> Iterator[Found]:
        """The class and its bases found in the release, depth first (bases outside vLLM are skipped)."""
        seen, stack = set(), [found]
        while stack:
            current = stack.pop(0)
            key = (current.module, current.node.name)
            if key in seen:
                continue
            seen.add(key)
            yield current
            bases = [self.expression(current.module, b) for b in current.node.bases]
            stack[0:0] = [b for b in bases if b is not None and b.kind == "class"]

    def member(self, owner: Found, name: str) -> tuple[str, ast.AST, Found] | None:
        """(kind, node, defining class) of attribute `name` of class `owner`: a method, a class-body assignment or
        annotation (enum members, dataclass fields), or `self.name = ...` in a method; through the bases."""
        for cls in self.mro(owner):
            methods = [st for st in cls.node.body if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef))]
            for st in cls.node.body:
                if st in methods and st.name == name:
                    return "method", st, cls
                if any(isinstance(t, ast.Name) and t.id == name for t in _targets(st)):
                    return "class attribute", st, cls
            for node in (node for fn in methods for node in ast.walk(fn)):
                if any(isinstance(t, ast.Attribute) and t.attr == name and isinstance(t.value, ast.Name)
                       and t.value.id == "self" for t in _targets(node)):
                    return "instance attribute", node, cls
        return None

    def lookup(self, target: str) -> tuple[Found | None, str]:
        """`module:Qual.name` -> (what it is, "") or (None, what is missing). A member comes back as a Found of its
        kind (`member`), its node, and "<module>:<defining class>" as its module."""
        module, _, qualname = target.partition(":")
        if self.tree(module) is None:
            return None, f"module {module}"
        if not qualname:
            return Found("module", module, self.tree(module)), ""
        first, *rest = qualname.split(".")
        found = self.resolve(module, first)
        if found is None:
            return None, f"{first} in {module}"
        for part in rest:
            if found.kind != "class":
                return None, f"{part} of {found.kind} {found.module}"
            member = self.member(found, part)
            if member is None:
                return None, f"{part} of {found.node.name} ({found.module})"
            kind, node, cls = member
            found = Found(kind, f"{cls.module}:{cls.node.name}", node)
        return found, ""


# -- checking the table --------------------------------------------------------------------------------------------


def _contains(node: ast.AST, snippet: str) -> bool:
    """Whether the source of `node` holds the statement or expression `snippet`, both normalised by ast.unparse."""
    wanted = ast.unparse(ast.parse(snippet))
    return wanted in ast.unparse(node)


def _literal(node: ast.AST):
    value = getattr(node, "value", None)
    try:
        return ast.literal_eval(value) if value is not None else None
    except ValueError:
        return ...  # not a literal: only its presence is checked


class Checker:
    """The static check of each kind of requirement against a release's source.

    module: the module exists. name: the name is bound there (defined, imported, re-exported or served by the
    module's __getattr__). class: it is a class. attrs: each name in spec is a member of the class (method, class
    attribute, dataclass field, self.attribute), through its bases. override: the method's parameters equal spec
    (names and kinds). call: the call spec still binds. returns: the method returns the name spec. values: each
    NAME=literal in spec (or NAME) is a class attribute with that value. source: the function's source holds the
    snippet spec. string: the module holds the string constant spec. assigned: the module assigns each attribute
    in spec on some object. backend: the enum member's value is the class path spec, and that class exists.
    mentions: the function names exactly these AttentionBackendEnum members (MLA ones aside)."""

    def __init__(self, source: Source):
        self.source = source

    def check(self, need: Need) -> Result:
        alternatives = [t.strip() for t in need.target.split("|")]
        results = []
        for target in alternatives:
            found, missing = self.source.lookup(target)
            if found is None:
                results.append(Result("MISSING", missing))
                continue
            result = getattr(self, "_" + need.kind)(found, need.spec, target)
            if len(alternatives) > 1 and result.status == "OK":
                result = ok(f"at {target.split(':')[0]}" + (f"; {result.detail}" if result.detail else ""))
            return result
        return Result("MISSING", " and ".join(r.detail for r in results))

    def _module(self, found, spec, target):
        return ok()

    def _name(self, found, spec, target):
        return ok("" if found.kind != "lazy" else "module __getattr__")

    def _class(self, found, spec, target):
        return ok() if found.kind == "class" else Result("CHANGED", f"now a {found.kind}, not a class")

    def _function(self, found) -> ast.AST | None:
        return found.node if isinstance(found.node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None

    def _override(self, found, spec, target):
        fn = self._function(found)
        if fn is None:
            return Result("CHANGED", f"now a {found.kind}, not a function")
        return compare_override(spec, _params(fn, found.kind == "method"))

    def _call(self, found, spec, target):
        if found.kind == "class":
            init = self.source.member(found, "__init__")
            params = _params(init[1], True) if init else [("args", "var-positional", False)]
            return compare_call(spec, params)
        fn = self._function(found)
        if fn is None:
            return Result("CHANGED", f"now a {found.kind}, not a function")
        return compare_call(spec, _params(fn, found.kind == "method"))

    def _attrs(self, found, spec, target):
        if found.kind != "class":
            return Result("CHANGED", f"now a {found.kind}, not a class")
        missing = [name for name in spec.split() if self.source.member(found, name) is None]
        return Result("MISSING", " ".join(missing)) if missing else ok()

    def _values(self, found, spec, target):
        problems = []
        for item in spec.split():
            name, _, literal = item.partition("=")
            member = self.source.member(found, name) if found.kind == "class" else None
            if member is None:
                problems.append(f"{name} missing")
            elif literal and _literal(member[1]) not in (ast.literal_eval(literal), ...):
                problems.append(f"{name} = {ast.unparse(member[1].value)}, expected {literal}")
        return Result("CHANGED", "; ".join(problems)) if problems else ok()

    def _returns(self, found, spec, target):
        fn = self._function(found)
        names = {ast.unparse(n.value) for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value} if fn else set()
        return ok() if spec in names else Result("CHANGED", f"returns {', '.join(sorted(names)) or 'nothing'}")

    def _source(self, found, spec, target):
        return ok() if _contains(found.node, spec) else Result("CHANGED", f"no longer holds `{spec}`")

    def _string(self, found, spec, target):
        present = any(isinstance(n, ast.Constant) and n.value == spec for n in ast.walk(found.node))
        return ok() if present else Result("MISSING", f"string {spec!r}")

    def _assigned(self, found, spec, target):
        assigned = {t.attr for n in ast.walk(found.node) for t in _targets(n) if isinstance(t, ast.Attribute)}
        missing = [name for name in spec.split() if name not in assigned]
        return Result("MISSING", " ".join(missing)) if missing else ok()

    def _backend(self, found, spec, target):
        value = _literal(found.node)
        if value != spec:
            return Result("CHANGED", f"value {value!r}, expected {spec!r}")
        module, _, name = spec.rpartition(".")
        cls, missing = self.source.lookup(f"{module}:{name}")
        return ok() if cls is not None and cls.kind == "class" else Result("MISSING", missing or f"class {spec}")

    def _mentions(self, found, spec, target):
        named = {n.attr for n in ast.walk(found.node) if isinstance(n, ast.Attribute)
                 and isinstance(n.value, ast.Name) and n.value.id == "AttentionBackendEnum" and "MLA" not in n.attr}
        expected = set(spec.split())
        if named == expected:
            return ok()
        return Result("CHANGED", f"added {sorted(named - expected)}, dropped {sorted(expected - named)}")


# -- the live check (the release importable here) -----------------------------------------------------------------


def _live_object(target: str):
    module, _, qualname = target.partition(":")
    obj = importlib.import_module(module)
    owner = None
    for part in qualname.split(".") if qualname else []:
        owner, obj = obj, getattr(obj, part)
    return owner, obj


def _live_params_of(owner, name: str, obj) -> list[tuple[str, str, bool]]:
    """Parameters of function `obj`, attribute `name` of `owner` (a module or a class: then without self/cls)."""
    if not inspect.isclass(owner):
        return _live_params(inspect.signature(obj))
    raw = next(vars(c)[name] for c in inspect.getmro(owner) if name in vars(c))
    if isinstance(raw, staticmethod):
        return _live_params(inspect.signature(raw.__func__))
    return _live_params(inspect.signature(getattr(raw, "__func__", raw)))[1:]


def live_check(need: Need) -> Result | None:
    """The same requirement checked on the imported release (None: the kind is checked statically only)."""
    if need.kind not in ("name", "class", "override", "call", "values", "backend"):
        return None
    errors = []
    for target in (t.strip() for t in need.target.split("|")):
        try:
            owner, obj = _live_object(target)
        except ImportError as err:
            if (getattr(err, "name", None) or "vllm").split(".")[0] == "vllm":
                errors.append(f"{target}: {err}")
                continue
            return ok(f"static only, not importable here ({err})")  # an optional dependency (flashinfer) missing
        except AttributeError as err:
            errors.append(f"{target}: {err}")
            continue
        except Exception as err:  # noqa: BLE001 - a module whose import needs a GPU or CUDA torch (flashinfer's)
            return Result("SKIP", f"static only, its import fails here: {type(err).__name__}: {str(err)[:100]}")
        name = target.partition(":")[2].rpartition(".")[2]
        if need.kind == "class" and not inspect.isclass(obj):
            return Result("CHANGED", "not a class (live)")
        if need.kind == "override":
            return compare_override(need.spec, _live_params_of(owner, name, obj))
        if need.kind == "call" and inspect.isclass(obj):
            return compare_call(need.spec, _live_params(inspect.signature(obj)))
        if need.kind == "call":
            return compare_call(need.spec, _live_params_of(owner, name, obj))
        if need.kind == "values":
            for item in need.spec.split():
                member, _, literal = item.partition("=")
                value = getattr(obj, member, None)
                value = getattr(value, "value", value)
                if value is None or (literal and value != ast.literal_eval(literal)):
                    return Result("CHANGED", f"{member} = {value!r} (live), expected {literal or 'present'}")
        if need.kind == "backend" and obj.value != need.spec:
            return Result("CHANGED", f"value {obj.value!r} (live)")
        return ok()
    return Result("MISSING", "; ".join(errors) + " (live)")


def _cuda_stand_in(platform):
    """`platform` (vLLM's UnspecifiedPlatform: a CUDA build on a machine without a GPU) answering as CUDA, so that
    the plugin takes its CUDA path: registration and the wrapped backends' classes only, nothing runs on it."""
    stand_in = type("CudaStandIn", (type(platform),), {"is_cuda": lambda self: True, "is_cpu": lambda self: False,
                                                       "device_name": "cuda (stood in for: no GPU here)"})
    return stand_in()


def live_plugin() -> Iterator[tuple[str, Result]]:
    """Import the plugin, register it as vLLM would with a sparse schedule, and resolve what it registered. A CUDA
    build on a machine without a GPU resolves no platform: CUDA is stood in for (`_cuda_stand_in`)."""
    users = os.environ.get("SPARROW_VLLM_SCHEDULE")
    os.environ["SPARROW_VLLM_SCHEDULE"] = "const:256"
    import vllm.platforms
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from sparrow.vllm import plugin, wrapped

    current_platform = vllm.platforms.current_platform
    stood_in = not (current_platform.is_cpu() or current_platform.is_cuda())
    if stood_in:
        current_platform = vllm.platforms.current_platform = _cuda_stand_in(current_platform)
    try:
        plugin.register()
        yield "register() under SPARROW_VLLM_SCHEDULE=const:256", ok(f"platform {current_platform.device_name}")
        if current_platform.is_cpu():
            from sparrow.vllm.cpu_attention import SparrowCPUAttentionBackend

            got = AttentionBackendEnum.CPU_ATTN.get_class()
            yield "CPU_ATTN resolves to Sparrow's CPU backend", (
                ok() if got is SparrowCPUAttentionBackend else Result("CHANGED", f"resolves to {got}"))
        for member in wrapped.WRAPPED:
            label = f"wrap({member}): vLLM's class, its builder and impl subclassed"
            try:
                cls = AttentionBackendEnum[member].get_class()  # on CUDA already the wrapper (registered above)
                cls = cls if cls.__name__.startswith(wrapped.PREFIX) else wrapped.wrap(cls)
            except Exception as err:  # noqa: BLE001 - a CUDA-only module fails to import in many ways on CPU
                yield label, Result("SKIP", f"cannot import here: {type(err).__name__}: {str(err)[:100]}")
                continue
            bypass = cls.forward_includes_kv_cache_update or getattr(cls, "supports_kv_cache_update_bypass", False)
            yield label, (ok(f"{cls.__name__}: {cls.get_builder_cls().__name__}, {cls.get_impl_cls().__name__}")
                          if not bypass else Result("CHANGED", "cache writes may bypass do_kv_cache_update"))
    finally:
        del os.environ["SPARROW_VLLM_SCHEDULE"]
        if stood_in:
            del vllm.platforms.current_platform  # back to vLLM's own (lazily resolved) platform
        plugin.register()  # unset: the plugin deactivates itself
        for member in ("CPU_ATTN", *wrapped.WRAPPED):
            AttentionBackendEnum[member].clear_override()
        if users is not None:
            os.environ["SPARROW_VLLM_SCHEDULE"] = users


# -- getting the release and reporting ----------------------------------------------------------------------------


def unpack_wheel(wheel: Path, into: Path) -> Path:
    """The Python source of a wheel (its .py files and metadata) under `into`."""
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(into, [n for n in archive.namelist() if n.endswith(".py") or ".dist-info/" in n])
    return into


def download(version: str, into: Path) -> Path | None:
    """pip download vllm==version (the CUDA release, no dependencies) and unpack its source (None: no such wheel)."""
    subprocess.run([sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps", "-q", "-d",
                    str(into)], check=False)
    wheel = next(into.glob(f"vllm-{version}-*.whl"), None)
    return None if wheel is None else unpack_wheel(wheel, into / "src")


def source_root(path: Path) -> Path | None:
    """The directory holding `vllm/` for a source tree, an unpacked wheel or the `vllm` package directory."""
    if (path / "vllm" / "__init__.py").is_file():
        return path
    if path.name == "vllm" and (path / "__init__.py").is_file():
        return path.parent
    return None


def release_version(root: Path) -> str:
    text = (root / "vllm" / "_version.py").read_text(encoding="utf-8") if (root / "vllm" / "_version.py").is_file() \
        else ""
    match = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)""", text)
    return match.group(1) if match else "unknown version"


def run(root: Path, live: bool, requirements=REQUIREMENTS, out=print) -> int:
    """Check `requirements` against the source under `root` (and live when `live`); 0 if all pass, 1 otherwise."""
    out(f"vLLM {release_version(root)} at {root / 'vllm'} ({'static and live' if live else 'static'} check)")
    checker, failed = Checker(Source(root)), 0
    for need in requirements:
        result = checker.check(need)
        if live and result.status == "OK":
            result = live_check(need) or result
        failed += result.status in ("MISSING", "CHANGED")
        detail = f"  {result.detail}" if result.detail else ""
        spec = f" {need.spec}" if need.kind in ("override", "call") else ""
        out(f"{result.status:8} {need.kind:8} {need.target}{spec}{detail}  [{need.used}]")
    if live:
        for label, result in live_plugin():
            failed += result.status in ("MISSING", "CHANGED")
            out(f"{result.status:8} plugin   {label}{'  ' + result.detail if result.detail else ''}")
    out(f"{'all requirements met' if not failed else f'{failed} requirement(s) not met'}")
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("release", nargs="?", default="installed",
                        help="a version to download (0.34.0), a .whl, an unpacked wheel or source tree, or "
                             "'installed' (default: the vLLM importable here, checked statically and live)")
    parser.add_argument("--download-dir", type=Path, help="where to download and unpack (default: a temporary "
                                                          "directory, removed afterwards)")
    parser.add_argument("--only", help="check only the requirements whose target contains this text")
    args = parser.parse_args(argv)
    requirements = [n for n in REQUIREMENTS if args.only is None or args.only in n.target]
    if not requirements:
        parser.error(f"--only {args.only!r} matches no requirement")
    if args.release == "installed":
        spec = importlib.util.find_spec("vllm")
        if spec is None:
            parser.error("no vLLM is installed here; pass a version, a wheel or a source tree")
        return run(Path(spec.origin).parent.parent, live=True, requirements=requirements)
    path = Path(args.release)
    if path.suffix == ".whl":
        from sparrow.io import file_problem

        problem = file_problem(path)
        if problem is None and not zipfile.is_zipfile(path):
            problem = "is not a wheel (not a zip archive); expected a vLLM .whl file"
        if problem is not None:
            print(f"check_vllm_release: error: {str(path)!r} {problem}", file=sys.stderr)
            return 2
        with tempfile.TemporaryDirectory() as tmp:
            return run(unpack_wheel(path, Path(tmp)), live=False, requirements=requirements)
    if path.exists():
        if source_root(path) is None:
            parser.error(f"{path} holds no vllm package; expected a wheel, an unpacked wheel or a source tree")
        return run(source_root(path), live=False, requirements=requirements)
    if not re.fullmatch(r"\d+(\.\d+)*([a-z0-9.+-]*)", args.release):
        parser.error(f"{args.release!r} is neither a path nor a vLLM version such as 0.34.0")
    with tempfile.TemporaryDirectory() as tmp:
        into = args.download_dir or Path(tmp)
        into.mkdir(parents=True, exist_ok=True)
        root = download(args.release, into)
        if root is None:
            parser.error(f"pip could not download vllm=={args.release} (see its message above)")
        return run(root, live=False, requirements=requirements)


if __name__ == "__main__":
    sys.exit(main())
