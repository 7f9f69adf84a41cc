"""The copied-prefill connector of `sparrow bench --backend vllm`: stock vLLM computes its first request's prompt and
copies that prompt's whole blocks into later requests, whose rollouts are then those of the source's K and V.

vLLM keeps one KV connector per process (its workers' shutdown clears it), so the engine runs in a child process."""

import json
import subprocess
import sys

from sparrow.engine import RolloutEngine, SamplingParams
from sparrow.schedules import DENSE
from tests.conftest import random_prompts, save_tiny_for_vllm

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True, num_logprobs=5)

CHILD = """
import json, sys
from sparrow.bench_vllm import copies_prefill
from sparrow.engine import SamplingParams
from sparrow.models import load_model
from sparrow.rollout.vllm_backend import VLLMBackend
from sparrow.schedules import DENSE
from sparrow.vllm.copied_prefill import kv_transfer_config
from tests.conftest import random_prompts

if __name__ == "__main__":
    _, tok = load_model(sys.argv[1])
    backend = VLLMBackend(sys.argv[1], tok, plugin=False, max_model_len=2048, kv_cache_gib=1, log=lambda m: None,
                          kv_transfer_config=kv_transfer_config())
    block = backend.llm.llm_engine.vllm_config.cache_config.block_size
    source, other, longer, short = random_prompts([2 * block + 44, 2 * block, 4 * block + 88, block - 20], seed=5)
    prompts = [source, other + source[2 * block:], longer, short]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True, num_logprobs=5)
    outs = [backend.generate([p], greedy, DENSE)[0] for p in prompts]  # one call each: the first is the source
    print("RESULT" + json.dumps({"block": block, "copies": copies_prefill(backend), "prompts": prompts,
                                 "outs": [[o.token_ids, o.logprobs] for o in outs]}))
"""


def _same(a, b) -> bool:
    return a[0] == b[0] and max(abs(x - y) for x, y in zip(a[1], b[1])) < 1e-3


def test_later_prompts_decode_from_the_first_prompts_copied_blocks(tmp_path):
    from sparrow.models import load_model

    path = save_tiny_for_vllm(tmp_path / "llama", "llama")
    run = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=300,
                         check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.split("RESULT")[-1])
    block, (source, same_length, longer, short) = got["block"], got["prompts"]
    first, copied, extended, computed = got["outs"]
    assert got["copies"]
    ours = RolloutEngine(*load_model(path))

    def reference(prompt):
        out = ours.generate([prompt], GREEDY, DENSE)[0]
        return [out.token_ids, out.logprobs]

    assert _same(first, reference(source))  # the first request: computed
    # a prompt as long whose whole blocks differ: the source's blocks (its own would decode otherwise)
    assert _same(copied, first) and not _same(reference(same_length), first)
    # a longer prompt: the source's two blocks, then its own tokens computed
    assert _same(extended, reference(source[:2 * block] + longer[2 * block:]))
    assert not _same(extended, reference(longer))
    # no whole block: nothing copied
    assert _same(computed, reference(short))
