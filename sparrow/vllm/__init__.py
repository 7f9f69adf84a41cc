"""Sparrow's sparse decode inside stock vLLM, as a plugin (entry point `vllm.general_plugins`: plugin.register).

env.py: what the plugin does, from environment variables; state.py: the configuration in force in this process
(a followed schedule file may change it at run time, through sparrow.schedules.runtime, which also writes the
report of it beside the file); plan.py: the per-step SparsePlan both backends share; checks.py: what is refused
at engine start; paged.py: the decode rule over a paged cache in PyTorch (the reference); cpu_attention.py:
vLLM's CPU attention backend with the rule; wrapped.py: on CUDA, the backend vLLM chooses wrapped, ours for the
sparse rows (triton_decode.py our kernel, graph_decode.py the fixed-shape CUDA-graph path); plugin.py:
registration.
Importing this package imports nothing of vLLM.
"""
