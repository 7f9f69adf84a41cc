"""Exact rollouts: the sparse actor drafts, the dense policy verifies (self-speculative decoding).

Each round, every live row holds a pending token (sampled, not yet cached). Up to K sparse decode steps (the
schedule, landmarks, dense layers and any DistillSparse adapter) draft K more tokens; then one dense span step
(adapter off) feeds the pending token and the drafts at once and gives the dense distribution at each of the K+1
positions. The dense token at each position is drawn with the same Gumbel noise as the draft there
(`sampling.gumbel_noise`), so a draft is accepted exactly when the dense policy draws the same token. The accepted
drafts keep the dense keys/values the span wrote over the draft's; the first mismatch takes the dense token and the
later drafts are dropped (their slots are rewritten later); if all K match, the last position gives one more dense
token. The committed tokens are therefore the ones dense decoding draws for the same seed, up to float rounding
between the span forward and one-token steps. With `SamplingParams.exact_rule` "residual", a draft is judged by
speculative sampling's rejection rule instead (`sampling.residual_rule`): the dense policy's distribution, not its
tokens for the seed, with every draft kept with probability alpha.

Every drafted token on the committed prefix has both distributions, so its exact acceptance alpha is recorded for
free (`Completion.draft_acceptance`); no teacher-forced pass is needed to monitor the draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sparrow.errors import SparrowError
from sparrow.lora import without_adapter
from sparrow.metrics import acceptance_rate
from sparrow.schedules import Schedule

from .finite import check_logits_finite
from .sampling import (ACCEPT_STREAM, RESIDUAL_STREAM, GumbelNoise, HostSample, SamplingParams, StepSample, choose,
                       gumbel_noise, residual_rule, sample, uniforms)
from .sequence import Completion, cached_lengths

MAX_DRAFT_TOKENS = 64
AUTO = 0  # draft_tokens 0: each round's draft length chosen from what the wave measured (DraftLength)
AUTO_START, AUTO_MAX = 4, 16


def parse_draft_tokens(value) -> int:
    """An option's draft length as the engine takes it, from the command line (a string) or a YAML file (an integer
    or a string): 'auto' -> AUTO, ASCII digits -> their integer, checked; anything else is refused."""
    if isinstance(value, str):
        text = value.strip().lower()
        value = AUTO if text == "auto" else int(text) if text.isascii() and text.isdigit() else value
    try:
        return check_draft_tokens(value)
    except SparrowError:
        raise SparrowError(f"draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}] or 'auto' (or 0), got "
                           f"{value!r}") from None


def check_draft_tokens(value) -> int:
    """The number of tokens drafted per verification: an integer in [1, MAX_DRAFT_TOKENS], or 0 (auto)."""
    if isinstance(value, bool) or not isinstance(value, int) or not AUTO <= value <= MAX_DRAFT_TOKENS:
        raise SparrowError(f"draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}] or 0 (auto), got {value!r}")
    return value


def max_draft(draft_tokens: int) -> int:
    """The most tokens one round may draft (the cache's spare slots beyond a row's end)."""
    return AUTO_MAX if draft_tokens == AUTO else draft_tokens


def choose_draft_length(acceptance: float, draft_s: float, verify_s: dict[int, float], max_k: int = AUTO_MAX) -> int:
    """The draft length K in 1..max_k that maximises expected tokens per second, E(a, K) / (K draft_s + t(K + 1)),
    with E(a, K) = sum_{i<=K} a^i and t(S) the seconds of a verification of S tokens: a line through the measured
    ones (`verify_s`: span -> seconds), or with one measured span, half of its time fixed and half per token."""
    spans = sorted(verify_s)
    if len(spans) == 1:
        (s0,) = spans
        slope, base = verify_s[s0] / (2 * s0), verify_s[s0] / 2
    else:
        xs = torch.tensor(spans, dtype=torch.float64)
        ys = torch.tensor([verify_s[x] for x in spans], dtype=torch.float64)
        slope = max(0.0, float(((xs - xs.mean()) * (ys - ys.mean())).sum() / ((xs - xs.mean()) ** 2).sum()))
        base = float(ys.mean()) - slope * float(xs.mean())
    rate = [sum(acceptance**i for i in range(k + 1)) / (k * draft_s + max(base + slope * (k + 1), 1e-9))
            for k in range(1, max_k + 1)]
    return 1 + max(range(max_k), key=rate.__getitem__)


@dataclass
class DraftLength:
    """Each round's draft length: `fixed`, or (fixed 0, auto) from what this wave measured so far: the coupled
    acceptance (accepted over judged drafts, starting from a prior of 9 in 10), the seconds of a draft step and of
    a verification per span (running means); `choose_draft_length` picks K, AUTO_START until both are measured."""

    fixed: int
    accepted: float = 9.0
    judged: float = 10.0
    draft_s: float | None = None
    verify_s: dict[int, float] = field(default_factory=dict)

    def next(self) -> int:
        if self.fixed:
            return self.fixed
        if self.draft_s is None or not self.verify_s:
            return AUTO_START
        return choose_draft_length(self.accepted / self.judged, self.draft_s, self.verify_s)

    def observe(self, count: int, draft_s: float, verify_s: float, took: list[int]) -> None:
        if self.fixed or not count:
            return
        self.accepted += sum(took)
        self.judged += sum(a + (a < count) for a in took)
        per_step = draft_s / count
        self.draft_s = per_step if self.draft_s is None else 0.8 * self.draft_s + 0.2 * per_step
        old = self.verify_s.get(count + 1)
        self.verify_s[count + 1] = verify_s if old is None else 0.8 * old + 0.2 * verify_s


def exact_wave(engine, cache, live: list[Completion], keys: torch.Tensor, logits: torch.Tensor,
               sampling: SamplingParams, schedule: Schedule, draft_tokens: int, bar) -> None:
    """Decode one wave in exact mode from the dense prefill's next-token `logits` [rows, V] until every
    sequence of `live` is finished. `engine` is the RolloutEngine whose cache rows `live` occupies."""
    vocab = logits.shape[-1]
    step = sample(logits, sampling, engine.noise(keys, live, sampling, vocab))
    host = HostSample.read(step)
    check_logits_finite(host, logits, live, sampling)
    engine.record(live, host, cached_lengths(live), sampling)
    for seq in live:
        seq.drafted.append(False)
        seq.draft_acceptance.append(None)
    bar.update(len(live))
    pending = step.tokens
    clock = engine.phases.lap("sample", engine.phases.now())
    length = DraftLength(draft_tokens)
    while True:
        bar.update(sum(sampling.max_new_tokens - len(seq.token_ids) for seq in live if seq.finished))
        live, (keys, pending) = engine.drop_finished(cache, live, keys, pending)
        if not live:
            break
        room = max(sampling.max_new_tokens - len(seq.token_ids) for seq in live) - 1
        count = min(length.next(), room)
        noise = [engine.noise(keys, live, sampling, vocab, ahead=j) for j in range(count + 1)]
        start = cache.lengths.clone()
        began = clock
        drafts, draft_logits = _draft(engine, cache, pending, sampling, schedule, noise[:count],
                                      cached_lengths(live) - 1)
        clock = engine.phases.lap("decode", clock)
        drafted_s = clock - began
        cache.lengths = start.clone()
        with without_adapter(engine.model):
            dense = engine.span_step(cache, torch.cat([pending[:, None], drafts], dim=1))  # [rows, count+1, V]
        verified_at = clock
        clock = engine.phases.lap("verify", clock)
        verify_s = clock - verified_at
        rows, span = dense.shape[:2]
        flat_noise = None if noise[0] is None else GumbelNoise.stack(noise)
        flat = sample(dense.view(rows * span, vocab), sampling, flat_noise)  # every position in one call
        steps = StepSample(*(t.view(rows, span, *t.shape[1:]) for t in (flat.tokens, flat.logprobs, flat.top_ids,
                                                                        flat.top_logprobs, flat.finite)))
        drafted = torch.stack(draft_logits, 1) if count else None  # [rows, count, V]
        if sampling.exact_rule == "residual" and count and not sampling.greedy:
            accepted, steps = _judge_residual(keys, live, sampling, drafted, dense, drafts, steps)
        else:  # coupled: a draft stands where the dense policy draws the same token with the same noise
            accepted = torch.cumprod((steps.tokens[:, :count] == drafts).long(), dim=1).sum(dim=1)  # [rows]
        tokens = steps.tokens  # the committed token at each position [rows, count+1], valid up to `accepted`
        alphas = (acceptance_rate(drafted, dense[:, :count], sampling.logprob_temperature)
                  if count else dense.new_zeros(rows, 0))
        took = _commit(engine, live, steps, dense, accepted, alphas, sampling, bar)
        length.observe(count, drafted_s, verify_s, took)
        cache.lengths = start + 1 + accepted
        pending = tokens.gather(1, accepted[:, None]).squeeze(1)
        clock = engine.phases.lap("sample", clock)


def _draft(engine, cache, pending: torch.Tensor, sampling: SamplingParams, schedule: Schedule,
           noise: list[torch.Tensor | None], lengths) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`len(noise)` sparse decode steps from `pending` (the rows' cached `lengths` before, as the host knows them):
    the drafted tokens [rows, K] and each step's logits."""
    tokens, logits = [], []
    token = pending
    for j, step_noise in enumerate(noise):
        step_logits, _ = engine.decode_step(cache, token, schedule, lengths + j)
        token = choose(step_logits / sampling.logprob_temperature, sampling, step_noise)
        tokens.append(token)
        logits.append(step_logits)
    empty = pending.new_zeros(len(pending), 0)
    return (torch.stack(tokens, dim=1) if tokens else empty), logits


def _judge_residual(keys: torch.Tensor, live: list[Completion], sampling: SamplingParams, draft_logits: torch.Tensor,
                    dense: torch.Tensor, drafts: torch.Tensor, steps: StepSample) -> tuple[torch.Tensor, StepSample]:
    """The residual rule (`sampling.residual_rule`) instead of the coupling: the accepted drafts per row [rows], and
    `steps` with each row's committed tokens (its accepted drafts, then the residual draw at the first rejection,
    or the dense draw after K accepted drafts) and their dense log-probs. The uniforms and redraws come from
    streams of their own, counter-based on the row's key and position like the token draws."""
    count, vocab = drafts.shape[1], dense.shape[-1]
    temperature = sampling.logprob_temperature
    base = torch.tensor([len(seq.token_ids) for seq in live], device=dense.device)
    positions = [base + j for j in range(count)]
    accept_u = torch.stack([uniforms(keys, at, ACCEPT_STREAM) for at in positions], dim=1)
    noise = torch.stack([gumbel_noise(keys, at, vocab, RESIDUAL_STREAM) for at in positions], dim=1)
    accepted, redraw = residual_rule(draft_logits / temperature, dense[:, :count] / temperature, drafts, accept_u,
                                     noise, sampling)
    tokens = steps.tokens.clone()
    tokens[:, :count] = drafts
    rejected = (accepted < count).nonzero().squeeze(1)
    tokens[rejected, accepted[rejected]] = redraw[rejected, accepted[rejected]]
    logp = torch.log_softmax(dense.float() / temperature, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
    return accepted, StepSample(tokens, logp, steps.top_ids, steps.top_logprobs, steps.finite)


def _commit(engine, live: list[Completion], steps: StepSample, dense: torch.Tensor, accepted: torch.Tensor,
            alphas: torch.Tensor, sampling: SamplingParams, bar) -> list[int]:
    """Record, per row, the dense tokens at positions 0..accepted[row] (stopping where the sequence finishes);
    `steps` holds the dense draws at every position [rows, count+1, ...]. Reads the device twice a round: the
    accepted lengths with the acceptances, and every position's draws. Returns the accepted drafts per row."""
    count = alphas.shape[1]
    judged = torch.cat([accepted[:, None].to(torch.float64), alphas.to(torch.float64)], dim=1).tolist()
    accepted_list, alpha_list = [int(r[0]) for r in judged], [r[1:] for r in judged]
    span = steps.tokens.shape[1]
    host = HostSample.read(StepSample(*(t.flatten(0, 1) for t in (steps.tokens, steps.logprobs, steps.top_ids,
                                                                   steps.top_logprobs, steps.finite))))
    for seq, took in zip(live, accepted_list):
        seq.verifies += 1
        seq.rejections += took < count
    for j in range(steps.tokens.shape[1]):
        rows = [r for r, seq in enumerate(live) if j <= accepted_list[r] and not seq.finished]
        if not rows:
            break
        at = [r * span + j for r in rows]
        part = HostSample(*([field[i] for i in at] for field in (host.tokens, host.logprobs, host.top_ids,
                                                                 host.top_logprobs, host.finite)))
        subset = [live[r] for r in rows]
        if not all(part.finite):
            check_logits_finite(part, dense[:, j].index_select(0, torch.tensor(rows, device=engine.device)), subset,
                                sampling)
        engine.record(subset, part, cached_lengths(subset), sampling)
        for r, seq in zip(rows, subset):
            seq.drafted.append(j < accepted_list[r])
            seq.draft_acceptance.append(alpha_list[r][j] if j < count else None)
        bar.update(len(rows))
    return accepted_list


def exact_summary(completions: list[Completion]) -> dict[str, float]:
    """What exact mode did over `completions`: verifications; tokens per verification (the mean accepted length
    plus the dense token each one adds); the share of tokens that were accepted drafts; the coupled acceptance
    (accepted drafts over drafts judged: a verification judges drafts up to its first rejection); and the mean
    exact acceptance alpha of the drafted tokens (what the optimal rejection rule would accept)."""
    verifies = sum(c.verifies for c in completions)
    if not verifies:
        raise SparrowError("these completions were not generated in exact mode (no verification recorded)")
    tokens = sum(len(c.token_ids) - 1 for c in completions)  # the first token comes from the prefill
    accepted = sum(sum(c.drafted) for c in completions)
    alphas = [a for c in completions for a in c.draft_acceptance if a is not None]
    judged = accepted + sum(c.rejections for c in completions)
    return {"verifies": verifies, "tokens_per_verify": tokens / verifies, "drafted_share": accepted / max(tokens, 1),
            "coupled_acceptance": accepted / judged if judged else float("nan"),
            "mean_alpha": sum(alphas) / len(alphas) if alphas else float("nan")}


def draft_rounds(completion: Completion, draft_tokens: int) -> list[tuple[int, int]]:
    """(cached length at the verification, drafts kept) of each whole round of a completion drafting
    `draft_tokens` a round, from its per-token record (`drafted`): after the prefill's token, a round commits its
    kept drafts and one dense token. A round cut by the end of the sequence is left out."""
    rounds, kept, start = [], 0, len(completion.prompt_token_ids) + 1
    for i, drafted in enumerate(completion.drafted[1:], start=1):
        if drafted:
            kept += 1
            continue
        rounds.append((start, min(kept, draft_tokens)))
        kept, start = 0, len(completion.prompt_token_ids) + i + 1
    return rounds
