"""Sparrow's sparse decode inside stock vLLM, as a plugin (entry point `vllm.general_plugins`: plugin.register).

config.py: what the plugin does, from environment variables (a schedule file may change at run time); plan.py:
the per-step SparsePlan both backends share; checks.py: what is refused at engine start; paged.py: the decode
rule over a paged cache in PyTorch (the reference); cpu_attention.py: vLLM's CPU attention backend with the rule;
wrapped.py: on CUDA, the backend vLLM chooses wrapped, ours for the sparse rows (triton_decode.py our kernel,
graph_decode.py the fixed-shape CUDA-graph path); plugin.py: registration.
Importing this package imports nothing of vLLM.
"""
