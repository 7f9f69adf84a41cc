"""`sparrow cost`: predicted cost of dense vs sparse rollouts from a model's config (no weights are loaded)."""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field

from sparrow.engine.exact import parse_draft_tokens
from sparrow.errors import SparrowError
from sparrow.io import require_file
from sparrow.measure.calibration import per_length_acceptance, profiled_schedule
from sparrow.measure.cost_model import MAX_LENGTH, check_trajectory, compare, equal_cost_constant, paper_cost
from sparrow.measure.exact_cost import DRAFTERS, best_draft_tokens, exact_decode
from sparrow.measure.training_cost import training_step
from sparrow.measure.profiling import read_profile
from sparrow.model_shapes import model_dims
from sparrow.options import SparseSection
from sparrow.schedules import Schedule
from sparrow.typed_config import check_finite, check_int, option, section

from .config import add_config_options, load_config
from .machine import MachineSection


def _integers(name: str, text) -> list[int]:
    """A comma-separated list of integers (a trailing comma allowed), or a SparrowError naming the option."""
    parts = str(text).split(",")
    if not parts[-1].strip():
        parts.pop()
    try:
        return [int(x) for x in parts]
    except ValueError:
        raise SparrowError(f"{name} must be comma-separated integers, got {text!r}") from None


@dataclass
class CostConfig:
    model: str = option("smollm2-135m", "smollm2-135m, qwen3-1.7b, qwen3-4b, qwen3-8b, qwen3-14b, tiny-llama, "
                                        "tiny-qwen2, tiny-qwen3 or a local Hugging Face model directory (only its "
                                        "config.json is read)")
    schedule: str | None = option(None, "sparse schedule: const:N, steps:BIN:b1,b2,..., start:budget,..., a preset "
                                        "name or a JSON file")
    prompt_len: int = option(256, f"prompt tokens (one shared prefill), at most {MAX_LENGTH:,}")
    gen_len: int = option(32768, f"generated tokens per sample (decode steps), at most {MAX_LENGTH:,}")
    samples: int = option(8, "samples decoded together from the prompt")
    prompt_lens: str | None = option(None, "comma-separated prompt lengths of a mixed-length task: also find the "
                                           "constant budget whose predicted cost over one trajectory per length equals "
                                           "the schedule's")
    machine: MachineSection = section(MachineSection)
    sparse: SparseSection = section(SparseSection)
    page_sizes: str | None = option(None, "comma-separated page sizes to compare at the same token budgets, e.g. "
                                          "16,32,64,128")
    acceptance: float | None = option(None, "exact mode: the per-token acceptance of the schedule's drafts (a "
                                            "profile's mean alpha, or bench's coupled acceptance); adds exact "
                                            "mode's predicted decode speedup")
    acceptance_profile: str | None = option(None, "exact mode: a profile.json of --schedule whose mean alpha per "
                                                  "length bin stands for the drafts' acceptance at those lengths "
                                                  "(instead of one --acceptance)")
    draft_tokens: int | str = option("auto", "exact mode: tokens drafted per dense verification, or auto (also 0): "
                                             "the best of 1-16")
    exact_drafter: str = option("shared", "exact mode's drafter: shared (our engine: drafts over the verified "
                                          "cache) or copy (vLLM's: a second copy of the model with its own cache, "
                                          "whose first pass each round rewrites the verified tokens densely)")
    training: bool = option(False, "also price a whole GRPO step of the group: the update (forward and backward "
                                   "of the prompt and every completion) both rollouts pay, and the exact monitor "
                                   "sparse ones pay")
    monitor_every: int = option(1, "with --training: the monitor runs every N-th step (train's monitor_every)")
    monitor_share: float = option(1.0, "with --training: share of the completions the monitor teacher-forces "
                                       "(train's monitor_share)")
    json: bool = option(False, "print one JSON object")
    parsed_schedule: Schedule | None = field(default=None, init=False, repr=False, compare=False)

    def validate(self) -> None:
        if self.schedule is None:
            raise SparrowError("give --schedule (a sparse schedule to compare with dense attention)")
        check_trajectory(self.prompt_len, self.gen_len, self.samples)
        self.sparse.validate()
        self.parsed_schedule = self.sparse.parse(self.schedule)
        if self.parsed_schedule.is_dense:
            raise SparrowError("schedule 'dense' leaves nothing to compare; give a sparse --schedule")
        self.page_size_list()
        self.prompt_len_list()
        self.machine.validate()
        if self.acceptance is not None:
            check_finite("acceptance", self.acceptance, 0, 1)
        self.draft_tokens = parse_draft_tokens(self.draft_tokens)
        check_int("monitor_every", self.monitor_every, 1)
        check_finite("monitor_share", self.monitor_share, 0, 1, low_open=True)
        if self.acceptance is not None and self.acceptance_profile is not None:
            raise SparrowError("give --acceptance (one value) or --acceptance-profile (per length bin), not both")
        if self.acceptance_profile is not None:
            require_file(self.acceptance_profile, "acceptance profile")
        if self.exact_drafter not in DRAFTERS:
            raise SparrowError(f"--exact-drafter {self.exact_drafter!r}: expected one of {', '.join(DRAFTERS)}")
        if self.draft_tokens and self.acceptance is None and self.acceptance_profile is None:
            raise SparrowError("--draft-tokens prices exact mode, which needs --acceptance (the drafts' per-token "
                               "acceptance, e.g. a profile's mean alpha) or --acceptance-profile")

    def page_size_list(self) -> list[int]:
        if not self.page_sizes:
            return []
        sizes = _integers("page_sizes", self.page_sizes)
        if not sizes or min(sizes) < 1 or len(set(sizes)) < len(sizes):
            raise SparrowError(f"page_sizes must be different positive integers, got {self.page_sizes!r}")
        return sizes

    def prompt_len_list(self) -> list[int]:
        if self.prompt_lens is None:
            return []
        lengths = _integers("prompt_lens", self.prompt_lens)
        if not lengths or not all(1 <= n <= MAX_LENGTH for n in lengths):
            raise SparrowError(f"prompt_lens must be one or more lengths from 1 to {MAX_LENGTH:,} tokens, got "
                               f"{self.prompt_lens!r}")
        return lengths

    def dense_layer_count(self, layers: int) -> int:
        indices = set(self.sparse.config().dense_layers)
        bad = sorted(i for i in indices if not 0 <= i < layers)
        if bad:
            raise SparrowError(f"dense_layers {bad} out of range for a model with {layers} layers")
        return len(indices)


def evaluate(config: CostConfig) -> dict:
    """The whole report as a dict (what --json prints)."""
    dims = model_dims(config.model)
    hw = config.machine.spec()
    schedule, sparse = config.parsed_schedule, config.sparse.config()
    pricing = config.machine.pricing(page_size=sparse.page_size, dense_layers=config.dense_layer_count(dims.layers),
                                     landmark=sparse.landmark)
    trajectory = (dims, hw, schedule, config.prompt_len, config.gen_len, config.samples)
    result = compare(*trajectory, pricing=pricing)
    rows = []
    for size in config.page_size_list():
        try:
            schedule.validate(size, sparse.always_kept_pages)
        except SparrowError as err:
            rows.append({"page_size": size, "skipped": str(err)})
            continue
        row = compare(*trajectory, pricing=dataclasses.replace(pricing, page_size=size))
        rows.append({"page_size": size, "sparse_cost": row["sparse_cost"],
                     "predicted_speedup": row["predicted_speedup"],
                     "sparse_attention_share": row["sparse_attention_share"]})
    lengths = config.prompt_len_list()
    if lengths:
        budget, ratio = equal_cost_constant(dims, hw, schedule, lengths, config.gen_len, config.samples,
                                            pricing=pricing)
        result["equal_cost_constant"] = {"budget": budget, "cost_ratio": ratio, "prompt_lens": lengths}
    acceptance = config.acceptance
    if config.acceptance_profile is not None:
        profile = read_profile(config.acceptance_profile)
        acceptance = per_length_acceptance(profile, profiled_schedule(profile, schedule))
    if acceptance is not None:
        price = (functools.partial(exact_decode, draft_tokens=config.draft_tokens) if config.draft_tokens
                 else best_draft_tokens)
        exact = price(*trajectory, acceptance=acceptance, pricing=pricing, drafter=config.exact_drafter)
        result["exact"] = {"draft_tokens": config.draft_tokens, **exact,
                           **({"per_length": acceptance} if isinstance(acceptance, list) else {})}
    if config.training:
        result["training"] = training_step(*trajectory, monitor_every=config.monitor_every,
                                           monitor_share=config.monitor_share, pricing=pricing)
    final_budget = schedule.budget_at(config.prompt_len + config.gen_len)
    paper = paper_cost(dims, hw, final_budget, config.prompt_len, config.gen_len, config.samples, sparse.page_size)
    return {
        "model": config.model,
        "params": dims.params,
        "kv_width": dims.kv_width,
        "gqa_ratio": dims.gqa_ratio,
        "hardware": {"name": hw.name, "peak_flops": hw.peak_flops, "bandwidth": hw.bandwidth,
                     "intensity": hw.intensity, "step_overhead": hw.step_overhead},
        "schedule": schedule.name,
        "prompt_len": config.prompt_len,
        "gen_len": config.gen_len,
        "samples": config.samples,
        "page_size": sparse.page_size,
        **result,
        "page_sizes": rows,
        "paper": {**paper, "budget": final_budget},
    }


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(h), *(len(r[c]) for r in rows)) for c, h in enumerate(header)]
    return ["  ".join(v.ljust(w) if c == 0 else v.rjust(w) for c, (v, w) in enumerate(zip(row, widths)))
            for row in (header, *rows)]


def _print(report: dict) -> None:
    hw = report["hardware"]
    print(f"model {report['model']}: {report['params'] / 1e9:.3f}B params, KV width {report['kv_width']}, "
          f"GQA ratio {report['gqa_ratio']:g}")
    overhead = f", {hw['step_overhead'] * 1e3:g} ms per forward pass" if hw["step_overhead"] else ""
    print(f"hardware {hw['name']}: {hw['peak_flops'] / 1e12:g} TFLOP/s, {hw['bandwidth'] / 1e12:g} TB/s, "
          f"I = {hw['intensity']:.1f} FLOP/byte{overhead}")
    print(f"trajectory: {report['prompt_len']} prompt + {report['gen_len']} generated tokens x {report['samples']} "
          f"samples, schedule {report['schedule']}, page size {report['page_size']}")
    print()
    rows = [("dense", f"{report['dense_cost']:.4g}", f"{report['dense_attention_share']:.1%}"),
            ("sparse", f"{report['sparse_cost']:.4g}", f"{report['sparse_attention_share']:.1%}")]
    for line in _table(("", "cost (equivalent FLOPs)", "attention share"), rows):
        print(line)
    print(f"predicted speedup: {report['predicted_speedup']:.2f}x (mean decode step: dense "
          f"{report['dense_step_s'] * 1e3:.3g} ms, sparse {report['sparse_step_s'] * 1e3:.3g} ms)")
    if "exact" in report:
        exact = report["exact"]
        source = f"{exact['acceptance']:.3g}" + (", its mean over the trajectory" if "per_length" in exact else "")
        print(f"exact mode (acceptance {source}): K = {exact['draft_tokens']} drafted tokens, "
              f"{exact['tokens_per_verify']:.2f} tokens per verification, decode {exact['exact_over_dense']:.2f}x "
              f"dense (sparse decode {exact['sparse_over_dense']:.2f}x)")
    if "training" in report:
        step = report["training"]
        every = "every step" if step["monitor_every"] == 1 else f"every {step['monitor_every']} steps"
        print(f"GRPO step (rollout + update, and for sparse rollouts the monitor: {step['monitor_rows']} of "
              f"{report['samples']} completions {every}):")
        print(f"  {step['step_speedup']:.2f}x dense; the dense step {step['dense_step_s']:.3g} s, "
              f"{step['update_share']:.0%} of it the update (a free rollout and monitor: at most "
              f"{step['step_speedup_limit']:.2f}x)")
    paper = report["paper"]
    print(f"paper formula (constant budget {paper['budget']} tokens): speedup {paper['speedup']:.2f}x")
    if "equal_cost_constant" in report:
        equal = report["equal_cost_constant"]
        print(f"constant budget of equal predicted cost over {len(equal['prompt_lens'])} prompts of "
              f"{min(equal['prompt_lens'])}-{max(equal['prompt_lens'])} tokens: const:{equal['budget']} "
              f"({equal['cost_ratio']:.3f}x the schedule's cost)")
    if report["page_sizes"]:
        print()
        print("page sizes at the same token budgets:")
        rows = []
        for row in report["page_sizes"]:
            if "skipped" in row:
                rows.append((str(row["page_size"]), "-", "-", "skipped: " + row["skipped"]))
            else:
                rows.append((str(row["page_size"]), f"{row['sparse_cost']:.4g}",
                             f"{row['predicted_speedup']:.2f}x", ""))
        for line in _table(("page size", "sparse cost", "speedup", ""), rows):
            print(line.rstrip())


def run(args) -> int:
    config = load_config(CostConfig, args)
    report = evaluate(config)
    if config.json:
        print(json.dumps(report))
    else:
        _print(report)
    return 0


def add_parser(sub) -> None:
    parser = sub.add_parser("cost", help="predict the cost of dense vs sparse rollouts (no weights loaded)",
                            description="Predict the cost of dense vs sparse rollouts in equivalent FLOPs "
                                        "(FLOPs + I x bytes; docs/cost-model.md).")
    add_config_options(parser, CostConfig)
    parser.set_defaults(run=run)
