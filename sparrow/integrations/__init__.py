"""Sparrow inside other RL frameworks (the top layer: it may import measure, rl and vllm; nothing imports it).

trl.py: `SparrowGRPOTrainer`, TRL's GRPOTrainer with sparse vLLM rollouts, Sparrow's exact tail monitor and a
schedule that changes while vLLM runs (docs/trl.md). The framework-independent parts, importable without TRL or
vLLM: config.py (`SparrowConfig`), monitor.py (the exact tail of a step's rollouts, gathered over processes),
schedule_file.py (the run-time schedule: fixed or adaptive, written for the plugin to follow), trl_cpu.py (the
patches TRL's colocated vLLM needs on vLLM's CPU build), versions.py (the tested versions; TRL's warning that
vLLM 0.32 is outside its range is filtered for that release only, from this package's import on).
"""

from .versions import quiet_tested_vllm_warning

quiet_tested_vllm_warning()
