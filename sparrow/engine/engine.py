"""The rollout engine's loop: shared prefill per prompt, batched decode with a per-sequence KV budget.

The n samples of a prompt share one dense prefill whose keys/values are copied into their n rows. Decode then
runs all live rows together; each row's budget comes from the schedule at its own cached length. Finished rows
are dropped from the batch so that later steps only pay for live sequences. Beside it: which prompts decode
together (`waves`), when a sequence ends (`stops`), the sampler (`sampling`), exact mode's loop (`exact`), where
the time went (`timing`) and the error for non-finite logits (`finite`). The CPU backend (`sparrow.cpu`) plugs in
its speed paths for the scope of a call (`frozen_weights`); the loop is the same on every device.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from sparrow.attention import (
    AttentionContext,
    KVCache,
    SparseConfig,
    enable_sparse_attention,
)
from sparrow.attention.interface import CONTEXT_KEY, base_model
from sparrow.cpu.backend import CpuBackend
from sparrow.errors import SparrowError
from sparrow.lora import without_adapter
from sparrow.schedules import DENSE, Schedule

from .arguments import check_generate
from .exact import exact_wave, max_draft
from .finite import check_logits_finite
from .prompts import Prompt, encode_prompt
from .sampling import GumbelNoise, HostSample, SamplingParams, sample, sequence_key
from .sequence import Completion, cached_lengths
from .stops import eos_ids, final_text, finish_reason
from .timing import PhaseClock
from .waves import Wave, plan_waves


class RolloutEngine:
    """Generates rollouts with sparse attention from any transformers causal LM (optionally peft-wrapped).
    How far they drift from the dense policy is measured outside the engine (`sparrow.measure.acceptance`)."""

    def __init__(self, model, tokenizer, sparse: SparseConfig | None = None, max_batch_size: int = 64):
        if max_batch_size < 1:
            raise SparrowError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.sparse = sparse or SparseConfig()
        self.max_batch_size = max_batch_size
        enable_sparse_attention(model)
        config = base_model(model).config
        self.num_layers = config.num_hidden_layers
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.max_positions = getattr(config, "max_position_embeddings", None)
        bad = [i for i in self.sparse.dense_layers if not 0 <= i < self.num_layers]
        if bad:
            raise SparrowError(f"dense_layers {bad} out of range for a model with {self.num_layers} layers")
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.eos_ids = eos_ids(tokenizer, model)
        self.phases = PhaseClock(self.device)
        self.cpu = CpuBackend(model)  # the CPU speed paths; loads the kernel where it applies (a first build here)
        # a prepared 4D mask: transformers returns it as it is instead of building one (and reading the device to
        # look for packed sequences); the engine's attention modes do not read it
        self.no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)

    @contextlib.contextmanager
    def frozen_weights(self):
        """A scope in which the model's weights do not change (one `generate` call, a benchmark's timed steps): its
        linear layers run packed and its decoder layers fused on CPU (`CpuBackend.frozen_weights`)."""
        with self.cpu.frozen_weights():
            yield

    @property
    def timing(self) -> dict[str, float]:
        """Seconds per phase of the last `generate` call (`timing.TIMED_PHASES`)."""
        return self.phases.seconds

    # -- building blocks (also used by the benchmark) -------------------------------------------------------

    def encode(self, prompt: Prompt, apply_chat_template: bool = False) -> list[int]:
        """Token ids of a prompt: text, chat messages (always templated) or ids as they are."""
        return encode_prompt(self.tokenizer, prompt, apply_chat_template)

    def new_cache(self, rows: int, capacity: int, slack: int = 0) -> KVCache:
        """A cache for `capacity` positions plus `slack` slots that only drafts beyond the end may write."""
        if self.max_positions and capacity > self.max_positions:
            raise SparrowError(
                f"prompt + max_new_tokens = {capacity} tokens exceeds the model's {self.max_positions} positions"
            )
        return KVCache(self.num_layers, rows, self.kv_heads, self.head_dim, capacity + slack, self.sparse,
                       self.dtype, self.device)

    def _forward(self, input_ids, position_ids, ctx: AttentionContext, keep: int = 1) -> torch.Tensor:
        """Logits of the last `keep` positions, float32 [B, V] (keep = 1) or [B, keep, V]."""
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=self.no_mask,
                         use_cache=False, logits_to_keep=keep, **{CONTEXT_KEY: ctx})
        return out.logits[:, -1].float() if keep == 1 else out.logits.float()

    @torch.no_grad()
    def prefill(self, cache: KVCache, prompt_ids: list[int], rows: torch.Tensor) -> torch.Tensor:
        """Dense prefill of one prompt into `rows` of the cache; returns the next-token logits [V]."""
        ids = torch.tensor([prompt_ids], device=self.device)
        positions = torch.arange(len(prompt_ids), device=self.device)[None]
        ctx = AttentionContext("prefill", self.sparse, cache=cache, rows=rows)
        logits = self._forward(ids, positions, ctx)[0]
        cache.lengths[rows] = len(prompt_ids)
        return logits

    @torch.no_grad()
    def decode_step(self, cache: KVCache, tokens: torch.Tensor, schedule: Schedule,
                    lengths: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed one token per row; returns (next-token logits [B, V], KV budget in tokens per row [B]). `lengths`:
        the rows' cached lengths as the host knows them, so that the step does not read them from the device."""
        total = cache.lengths + 1
        budget = kv_budgets(schedule, total)
        ps = self.sparse.page_size
        pages = None if schedule.is_dense else budget // ps
        known_pages = None if schedule.is_dense or lengths is None else kv_budgets(schedule, lengths + 1) // ps
        ctx = AttentionContext("decode", self.sparse, cache=cache, step=cache.begin_step(pages, lengths, known_pages))
        logits = self._forward(tokens[:, None], cache.lengths[:, None], ctx)
        cache.lengths += 1
        return logits, budget

    @torch.no_grad()
    def span_step(self, cache: KVCache, tokens: torch.Tensor) -> torch.Tensor:
        """Feed S tokens per row [B, S] densely at each row's length; returns the logits after each [B, S, V]."""
        span = tokens.shape[1]
        ctx = AttentionContext("span", self.sparse, cache=cache, step=cache.begin_span(span))
        positions = cache.lengths[:, None] + torch.arange(span, device=self.device)
        logits = self._forward(tokens, positions, ctx, keep=span).view(tokens.shape[0], span, -1)
        cache.lengths += span
        return logits

    # -- generation -----------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Prompt], sampling: SamplingParams | None = None,
                 schedule: Schedule = DENSE, num_samples: int = 1, apply_chat_template: bool = False,
                 progress: bool = False, prompt_keys: Sequence[int] | None = None,
                 draft_tokens: int | None = None) -> list[Completion]:
        """Generate `num_samples` completions per prompt; returned grouped by prompt, then sample index.

        `draft_tokens` None decodes with `schedule`; an integer K runs exact mode (`engine.exact`): `schedule`
        drafts up to K tokens per dense verification (0: a length chosen each round from what was measured) and
        the completions are the dense policy's own samples.

        Sample s of the prompt keyed k draws with its own random key, `sequence_key(sampling.seed, k, s)`
        (keys default to the prompts' indices in the call; distinct integers in [0, 2**32)). With a seed, its tokens
        are therefore the same whatever `max_batch_size`, the other prompts of the call, or `num_samples` (sample s
        of n is sample s of n + 2): callers that split a set of prompts over calls or workers pass each prompt's
        key. Stops with a SparrowError naming the sequence and token when the model's logits are not finite.
        """
        sampling = sampling or SamplingParams()
        keys = check_generate(prompts, num_samples, prompt_keys, draft_tokens)
        if not schedule.is_dense:
            schedule.validate(self.sparse.page_size, self.sparse.always_kept_pages)
        encoded = [self.encode(p, apply_chat_template) for p in prompts]
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(64)
        self.phases.reset()
        results: list[Completion] = []
        with self.frozen_weights(), tqdm(total=len(prompts) * num_samples * sampling.max_new_tokens,
                                         desc="generating", unit="tok", disable=not progress) as bar:
            for wave in plan_waves(encoded, keys, num_samples, self.max_batch_size, sampling):
                results += self._generate_wave(wave, self.row_keys(seed, wave.seqs), sampling, schedule, bar,
                                               draft_tokens)
        return results

    def row_keys(self, seed: int, seqs: list[Completion]) -> torch.Tensor:
        """The random key of each sequence [rows, 2] (int32 on the engine's device), see `sequence_key`."""
        return torch.tensor([sequence_key(seed, s.prompt_key, s.sample_index) for s in seqs], dtype=torch.int32,
                            device=self.device)

    def noise(self, keys: torch.Tensor, live: list[Completion], sampling: SamplingParams,
              vocab: int, ahead: int = 0, positions: torch.Tensor | None = None) -> GumbelNoise | None:
        """The Gumbel noise of each live sequence's next token (`ahead` tokens further on); None if greedy.
        `positions`: the sequences' generated lengths kept on the device (no list copied to it each step)."""
        if sampling.greedy:
            return None
        if positions is None:
            positions = self.positions(live, ahead)
        return GumbelNoise(keys, positions, vocab)

    def positions(self, live: list[Completion], ahead: int = 0) -> torch.Tensor:
        """Each sequence's generated tokens (plus `ahead`) [rows] on the engine's device."""
        return torch.tensor([len(seq.token_ids) + ahead for seq in live], device=self.device)

    def _generate_wave(self, wave: Wave, keys: torch.Tensor, sampling: SamplingParams, schedule: Schedule, bar,
                       draft_tokens: int | None) -> list[Completion]:
        exact = draft_tokens is not None
        cache = self.new_cache(len(wave.seqs), wave.capacity, slack=max_draft(draft_tokens) if exact else 0)
        clock = self.phases.now()
        with without_adapter(self.model) if exact else contextlib.nullcontext():  # exact: dense prefill
            logits = self._prefill_wave(cache, wave)
        self.phases.lap("prefill", clock)
        self.decode_wave(cache, wave.seqs, keys, logits, sampling, schedule, bar, draft_tokens)
        for seq in wave.seqs:
            seq.text = final_text(self.tokenizer, seq.token_ids, sampling.stop)
        return wave.seqs

    def decode_wave(self, cache: KVCache, seqs: list[Completion], keys: torch.Tensor, logits: torch.Tensor,
                    sampling: SamplingParams, schedule: Schedule, bar, draft_tokens: int | None = None) -> None:
        """Decode `seqs` (cache row r holds seqs[r]'s prefilled prompt; `logits` [rows, V] their next-token logits)
        until each is finished, with `schedule` or, given `draft_tokens`, in exact mode. `cache` is consumed."""
        if draft_tokens is not None:
            exact_wave(self, cache, list(seqs), keys, logits, sampling, schedule, draft_tokens, bar)
            return
        live = list(seqs)
        budget = cached_lengths(live)  # the prefill's records are dense: the cached length
        positions = None if sampling.greedy else self.positions(live)
        clock = self.phases.now()
        while True:
            step = sample(logits, sampling, self.noise(keys, live, sampling, logits.shape[-1], positions=positions))
            host = HostSample.read(step)  # the step's one read of the device
            check_logits_finite(host, logits, live, sampling)
            self.record(live, host, budget, sampling)
            bar.update(len(live) + sum(sampling.max_new_tokens - len(seq.token_ids) for seq in live if seq.finished))
            if positions is not None:
                positions = positions + 1
            live, (keys, step.tokens, positions) = self.drop_finished(cache, live, keys, step.tokens, positions)
            if not live:
                break
            clock = self.phases.lap("sample", clock)
            total = cached_lengths(live)  # counting the token this step feeds
            logits, _ = self.decode_step(cache, step.tokens, schedule, total - 1)
            budget = kv_budgets(schedule, total)
            clock = self.phases.lap("decode", clock)
        self.phases.lap("sample", clock)

    def drop_finished(self, cache: KVCache, live: list[Completion],
                      *rows: torch.Tensor) -> tuple[list[Completion], list[torch.Tensor]]:
        """The unfinished sequences of `live` and the matching rows of each tensor in `rows`, with the cache
        compacted to them (`KVCache.keep`); an empty list when every sequence is finished."""
        keep = [r for r, seq in enumerate(live) if not seq.finished]
        if not keep or len(keep) == len(live):
            return [seq for seq in live if not seq.finished], list(rows)
        keep = cache.keep(keep)
        index = torch.tensor(keep, device=self.device)
        return [live[r] for r in keep], [None if t is None else t.index_select(0, index) for t in rows]

    def _prefill_wave(self, cache: KVCache, wave: Wave) -> torch.Tensor:
        """Prefill each prompt of the wave into its rows; next-token logits per row [rows, V]."""
        logits = []
        for j, ids in enumerate(wave.prompt_ids):
            rows = torch.arange(j * wave.samples, (j + 1) * wave.samples, device=self.device)
            logits.append(self.prefill(cache, ids, rows).expand(wave.samples, -1))
        return torch.cat(logits)

    def record(self, live: list[Completion], step: HostSample, budget, sampling: SamplingParams):
        """Append each row's sampled token and its records (`step`, read from the device; `budget` the KV budget
        of each row, integers) to `live[row]`; mark the sequences that finish."""
        for r, seq in enumerate(live):
            seq.token_ids.append(step.tokens[r])
            seq.logprobs.append(step.logprobs[r])
            seq.top_token_ids.append(step.top_ids[r])
            seq.top_logprobs.append(step.top_logprobs[r])
            seq.kv_budget.append(int(budget[r]))
            seq.finish_reason = finish_reason(seq, self.eos_ids, sampling, self.tokenizer)


def kv_budgets(schedule: Schedule, total: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """The KV budget a decode step records for rows with `total` cached tokens (counting the new one; a tensor, or
    a numpy array on the host): the schedule's budget, or the cached length itself when dense."""
    if schedule.is_dense:
        return total.copy() if isinstance(total, np.ndarray) else total.clone()
    return schedule.budget_for(total)


