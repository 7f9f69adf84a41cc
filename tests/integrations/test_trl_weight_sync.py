"""TRL's colocated weight sync on vLLM's CPU build (sparrow/integrations/trl_cpu.py) is exact: after a GRPO step at
a large learning rate, and after every parameter is perturbed, vLLM's prompt log-probs equal the trained model's
(float32, within 1e-4), on a tiny Llama whose LM head is tied to its token embedding (as SmolLM2's is). Three
runs: the dense schedule; a sparse one (const:64), where the tokens vLLM samples after a prompt cached before the
sync must also equal the model's sparse teacher-forced log-probs (the cached pages' landmarks come from the new
weights' keys); and a LoRA adapter (TRL's `peft_config`), which TRL merges into the weights it sends.

Before the fix the tied LM head kept its old packed weights on CPU (TRL sends the tied weight once, as
`model.embed_tokens.weight`; vLLM reprocesses only the layers it loads): 0.16 nats after the step, 1.17 after the
perturbation."""

import os
from contextlib import nullcontext
from types import SimpleNamespace

import pytest

from tests.conftest import save_tiny_for_vllm
from tests.integrations.weight_sync import (PROMPT, FailedLoads, completion_logprob_gap, perturb_every_parameter,
                                            prompt_logprob_gap)

pytest.importorskip("trl")
pytest.importorskip("vllm")

EXACT = 1e-4


@pytest.mark.parametrize("lora", [False, True])
def test_what_trls_sync_sends_names_the_tied_weight_under_both_names_as_a_state_dict_does(tmp_path, lora):
    """TRL 1.16's own iteration (PEFT merge and name fixes), with Sparrow's aliases: every name of the base model's
    state dict, once, the LM head right after the embedding it is tied to."""
    from transformers import AutoModelForCausalLM
    from trl.generation.vllm_generation import VLLMGeneration

    from sparrow.integrations.trl_cpu import trl_vllm_name
    from sparrow.lora import LoraSpec, attach_adapter
    from sparrow.vllm.weights import tied_aliases, with_tied_aliases

    base = AutoModelForCausalLM.from_pretrained(save_tiny_for_vllm(tmp_path / "tiny-tied", tied=True))
    checkpoint_names = sorted(base.state_dict())  # lm_head.weight and model.embed_tokens.weight among them
    model = attach_adapter(base, LoraSpec(rank=4, alpha=8)) if lora else base
    generation = VLLMGeneration.__new__(VLLMGeneration)  # what its sync reads: the model and the gather context
    generation.model = model
    generation._dist = SimpleNamespace(gather_params=lambda params: nullcontext(), is_fsdp=False)
    trls = [name for name, _ in generation._iter_named_params()]
    aliases = tied_aliases(model.named_parameters(remove_duplicate=False), lambda n: trl_vllm_name(generation, n))
    sent = [name for name, _ in with_tied_aliases(generation._iter_named_params(), aliases)]
    assert "lm_head.weight" not in trls and aliases == {"model.embed_tokens.weight": ["lm_head.weight"]}
    assert sorted(sent) == checkpoint_names
    assert sent.index("lm_head.weight") == sent.index("model.embed_tokens.weight") + 1


def byte_reward(completions, **_):
    """Differs between completions, so GRPO's advantages (and gradients) are not zero."""
    return [float(sum(map(ord, c)) % 97) for c in completions]


RUNS = {"dense": ("dense", False), "sparse": ("const:64", False), "lora": ("dense", True)}


@pytest.fixture(scope="module", params=list(RUNS))
def trainer(tmp_path_factory, request):
    import datasets
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import GRPOConfig

    from sparrow.integrations.config import SparrowConfig
    from sparrow.integrations.trl import SparrowGRPOTrainer

    schedule, lora = RUNS[request.param]
    tmp = tmp_path_factory.mktemp(f"trl-sync-{request.param}")
    model_dir = str(save_tiny_for_vllm(tmp / "tiny-tied", tied=True))
    saved = dict(os.environ)
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", SPARROW_HUGE_PAGES="0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, sorted(os.sched_getaffinity(0)))))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    args = GRPOConfig(output_dir=str(tmp / "run"), max_steps=1, learning_rate=1e-2, save_strategy="no",
                      report_to="none", use_cpu=True, bf16=False, seed=0, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=8, temperature=1.0, use_vllm=True,
                      vllm_mode="colocate", vllm_max_model_length=512)
    rows = [{"prompt": "the weights move " * 4}] * 4
    peft = {"peft_config": LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")} if lora else {}
    trainer = SparrowGRPOTrainer(model=model_dir, reward_funcs=byte_reward, args=args,
                                 train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer,
                                 sparrow_config=SparrowConfig(schedule=schedule), **peft)
    trainer.sparrow_test_schedule = schedule
    yield trainer
    trainer.vllm_generation.llm = None
    os.environ.clear()
    os.environ.update(saved)


def cached_prompt_gap(trainer, prompt=PROMPT[:150], schedule=None) -> float:
    """Largest |log p_vLLM - log p_model| over 16 tokens vLLM samples after `prompt` under the run's schedule (the
    plugin follows the trainer's schedule file), the model teacher-forced under the same schedule; the prompt's
    blocks stay in vLLM's prefix cache until the next sync resets it."""
    from vllm import SamplingParams

    sampling = SamplingParams(temperature=1.0, max_tokens=16, seed=3, ignore_eos=True, logprobs=0)
    out = trainer.vllm_generation.llm.generate([{"prompt_token_ids": prompt}], sampling, use_tqdm=False)[0].outputs[0]
    logprobs = [entry[token].logprob for entry, token in zip(out.logprobs, out.token_ids)]
    return completion_logprob_gap(trainer.model, prompt, out.token_ids, logprobs,
                                  schedule or trainer.sparrow_test_schedule)


def test_the_tiny_model_ties_its_lm_head_and_vllm_starts_in_sync(trainer):
    from sparrow.attention.interface import base_model

    model = base_model(trainer.model)  # under a peft wrapper with LoRA
    assert model.config.tie_word_embeddings
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert prompt_logprob_gap(trainer.vllm_generation.llm, trainer.model) < EXACT


def test_a_grpo_step_at_a_large_learning_rate_then_sync_leaves_vllm_exact(trainer):
    model = trainer.model
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer.train()
    moved = {name: float((p.detach() - before[name]).abs().max()) for name, p in model.named_parameters()}
    if hasattr(model, "peft_config"):  # only the adapter trains (lora_A has no gradient while lora_B is zero)
        assert min(v for name, v in moved.items() if "lora_B" in name) > 1e-3
        assert max(v for name, v in moved.items() if "lora_" not in name) == 0
    else:
        assert moved["model.embed_tokens.weight"] > 1e-3 and min(moved.values()) > 0  # every weight trained
    stale = prompt_logprob_gap(trainer.vllm_generation.llm, model)
    assert stale > 1e-2  # vLLM still holds the weights the step's rollouts were sampled with
    with FailedLoads() as failed:
        trainer.vllm_generation.sync_weights()
    gap = prompt_logprob_gap(trainer.vllm_generation.llm, model)
    assert gap < EXACT, f"vLLM's prompt log-probs are {gap:.3g} nats off the trained model's after the sync"
    assert failed == []  # no layer kept its old weights (the rotary cache's message is Sparrow-filtered)


def test_perturbing_every_parameter_tied_embedding_included_then_sync_leaves_vllm_exact(trainer):
    model = trainer.model
    assert cached_prompt_gap(trainer) < EXACT  # the prompt's blocks now sit in vLLM's prefix cache
    if trainer.sparrow_test_schedule != "dense":  # vLLM decoded them sparsely: the dense model disagrees
        assert cached_prompt_gap(trainer, schedule="dense") > 1e-3
    perturb_every_parameter(model)  # with LoRA: the frozen base weights and the adapter's
    with FailedLoads() as failed:
        trainer.vllm_generation.sync_weights()
    gap = prompt_logprob_gap(trainer.vllm_generation.llm, model)
    assert gap < EXACT, f"vLLM's prompt log-probs are {gap:.3g} nats off the perturbed model's after the sync"
    gap = cached_prompt_gap(trainer)
    assert gap < EXACT, (f"after a prompt cached before the sync, vLLM's {trainer.sparrow_test_schedule} log-probs "
                         f"are {gap:.3g} nats off the perturbed model's")
    assert failed == []
