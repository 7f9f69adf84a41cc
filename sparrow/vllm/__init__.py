"""Sparrow's sparse decode inside stock vLLM, as a plugin (entry point `vllm.general_plugins`: plugin.register).

config.py: what the plugin does, from environment variables; paged.py: the decode rule over a paged cache in
PyTorch (the reference); cpu_attention.py: vLLM's CPU attention backend with the rule; plugin.py: registration.
Importing this package imports nothing of vLLM.
"""
