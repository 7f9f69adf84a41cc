"""Pick the cheapest schedule that holds the tail acceptance at or above tau in every length bin (pure).

Input: a profile (see profiling.py) measured with several schedules, binned by total cached length. For every
bin, each profiled schedule offers the budget it had there and the 5th percentile it reached; the calibrated
schedule takes the smallest budget whose 5th percentile is at least tau + margin (with enough tokens to trust
it), then is made non-decreasing in length, so a longer sequence never gets less than a shorter one. No budget
is below the always-kept pages (sink and recent), which every schedule must cover: a short bin measured dense
gets that minimum, under which its lengths still run dense.

With a minimum reward retention (profiles made with a reward), a schedule whose retention estimate is below it
offers nothing, and every bin gets at least the budget of the cheapest schedule that kept the reward, so the
composed schedule is never cheaper than a schedule known to keep it.

Each bin's choice says which criterion bound its budget (`binding_criteria`): the tail, the reward floor, a
shorter bin's budget (non-decreasing), none (the smallest profiled budget already holds tau), or, with
`unreached="dense"`, no profiled budget reaching tau, so the bin runs dense.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from sparrow.attention.config import SparseConfig
from sparrow.errors import SparrowError
from sparrow.measure.cost_model import Pricing
from sparrow.measure.exact_cost import best_draft_tokens
from sparrow.measure.retention import Retention
from sparrow.schedules import Schedule, parse_schedule
from sparrow.typed_config import short_repr


@dataclass(frozen=True)
class BinChoice:
    """One bin's calibration: `budget`, the cheapest that holds tau + margin there (a budget covering the bin
    when none does and `unreached` is dense), its p5, tokens and schedule (`source`); `bound_by`, what set the
    bin's budget in the composed schedule (`binding_criteria`)."""

    start: int
    end: int
    budget: int
    p5: float
    tokens: int
    source: str
    bound_by: str = ""


TAIL, FLOOR, SHORTER, SMALLEST, UNREACHED = ("tau", "reward floor", "non-decreasing", "smallest profiled",
                                            "dense: tau unreached")
"""What can bind a bin's budget: the tail (a cheaper profiled budget missed tau + margin), the reward floor
(--min-retention's cheapest eligible schedule), a shorter bin's budget (budgets never fall with length), nothing
(every profiled budget holds tau: the smallest one stands), or nothing reaching tau (the bin runs dense)."""

UNREACHED_ACTIONS = ("fail", "dense")


def binding_criteria(tail: int, tail_excluded: bool, unreached: bool, floor: int, shorter: int, final: int) -> str:
    """Which criteria gave a bin its `final` budget, joined by ' + ' when the tail and the floor ask for the same:
    `tail`, the cheapest budget holding tau + margin (with `unreached`, none did and `tail` covers the bin);
    `tail_excluded`, whether a cheaper profiled budget missed tau + margin; `floor`, the reward floor's budget there
    (0 without one); `shorter`, the budget of the bin before (0 for the first), named only when it alone is
    highest."""
    if shorter > max(tail, floor):
        return SHORTER
    found = [UNREACHED if unreached else TAIL] if tail == final and (unreached or tail_excluded) else []
    found += [FLOOR] if floor and floor == final else []
    return " + ".join(found or [SMALLEST])


_BIN_FIELDS = {"bin": int, "start": int, "end": int, "count": int, "p5": (int, float)}
_BUDGET_FIELDS = {"start": int, "kv_budget": int}


def _field_problem(item, fields: dict) -> str | None:
    """What is wrong with one bin or budget object, or None."""
    if not isinstance(item, dict):
        return f"{item!r} is not an object"
    for name, kind in fields.items():
        value = item.get(name)
        if isinstance(value, bool) or not isinstance(value, kind):
            expected = "an integer" if kind is int else "a number"
            return f"{name} is {short_repr(value)}; expected {expected}" if name in item else f"has no {name!r}"
    return None


def _finite(value, low: float | None = None, high: float | None = None) -> bool:
    """Whether `value` is a JSON number (not a bool or a string), finite, within the bounds given."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and (low is None or value >= low) and (high is None or value <= high))


def _rate_problem(item: dict) -> str | None:
    """An acceptance statistic of a profile bin that is not a finite number in [0, 1], or None."""
    for name in ("mean", "p1", "p5", "p50"):
        if name in item and not _finite(item[name], 0.0, 1.0):
            return f"{name} is {short_repr(item[name])}; expected a finite number in [0, 1] (an acceptance rate)"
    return None


def check_profile(profile, source: str = "the profile") -> None:
    """A SparrowError naming the first part of `profile` that is not what 'sparrow profile' writes: an object with
    "schedules" holding, per schedule, a list of "bins" ({bin, start, end, count, p5}) and optionally its
    "budgets" ({start, kv_budget}), and an optional "meta" object."""
    if not isinstance(profile, dict):
        raise SparrowError(f"{source} holds a JSON {type(profile).__name__}; expected the object 'sparrow profile' "
                           "writes (with 'schedules')")
    meta = profile.get("meta", {})
    if not isinstance(meta, dict) or not all(isinstance(meta.get(k, {}), dict) for k in ("sparse", "sampling")):
        raise SparrowError(f"{source}: 'meta' is {short_repr(meta)}; expected an object (as 'sparrow profile' "
                           "writes)")
    for where, value, kind in (("meta.sparse.page_size", meta.get("sparse", {}).get("page_size", 16), int),
                               ("meta.sampling.max_new_tokens", meta.get("sampling", {}).get("max_new_tokens", 1), int),
                               ("meta.prompt_tokens_mean", meta.get("prompt_tokens_mean", 1), (int, float)),
                               ("meta.model", meta.get("model", ""), str)):
        if isinstance(value, bool) or not isinstance(value, kind) or (kind is int and value < 1):
            expected = {int: "a positive integer", str: "a model name"}.get(kind, "a number")
            raise SparrowError(f"{source}: {where} is {short_repr(value)}; expected {expected}")
    schedules = profile.get("schedules")
    if not isinstance(schedules, dict) or not schedules:
        raise SparrowError(f"{source} holds no schedules; expected a non-empty 'schedules' object")
    for name, spec in schedules.items():
        if not isinstance(spec, dict) or not isinstance(spec.get("bins"), list):
            raise SparrowError(f"{source}: schedule {name!r} has no 'bins' list; expected the per-length-bin "
                               "statistics 'sparrow profile' writes")
        if not isinstance(spec.get("budgets") or [], list):
            raise SparrowError(f"{source}: schedule {name!r} has budgets {short_repr(spec['budgets'])}; "
                               "expected a list")
        for what, items, fields in (("bin", spec["bins"], _BIN_FIELDS),
                                    ("budget", spec.get("budgets") or [], _BUDGET_FIELDS)):
            for position, item in enumerate(items):
                problem = _field_problem(item, fields) or (_rate_problem(item) if what == "bin" else None)
                if problem is not None:
                    raise SparrowError(f"{source}: schedule {name!r}, {what} {position}: {problem}")
        reward = spec.get("reward")
        retention = reward.get("retention") if isinstance(reward, dict) else None
        if isinstance(retention, dict):
            for key in ("value", "low", "high"):
                value = retention.get(key)
                if value is not None and not _finite(value, 0.0 if key == "value" else None):
                    raise SparrowError(f"{source}: schedule {name!r}, reward.retention.{key} is {short_repr(value)}; "
                                       f"expected a finite number{' >= 0' if key == 'value' else ''} or null")


def always_kept_pages(meta: dict, source: str = "the profile") -> int:
    """The pages every sparse step of the profile kept: meta.sparse's sink and recent pages (SparseConfig's
    defaults when absent)."""
    sparse, kept = meta.get("sparse", {}), 0
    for name, least in (("sink_pages", 0), ("recent_pages", 1)):
        value = sparse.get(name, getattr(SparseConfig, name))
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise SparrowError(f"{source}: meta.sparse.{name} is {short_repr(value)}; expected an integer >= {least}")
        kept += value
    return kept


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def offered_budget(spec: dict, start: int, end: int, page_size: int) -> int:
    """The largest budget a profiled schedule used in [start, end) (dense: enough to cover the bin)."""
    bins = spec.get("budgets") or []
    if not bins:
        return _round_up(end, page_size)
    inside = [b["kv_budget"] for b in bins if start <= b["start"] < end]
    before = [b["kv_budget"] for b in bins if b["start"] <= start]
    return max(inside + before[-1:])


def profile_retention(profile: dict) -> dict[str, Retention]:
    """Each profiled schedule's reward retention (written by 'sparrow profile --reward'); refuses a profile
    without it."""
    out = {}
    for name, spec in profile["schedules"].items():
        reward = spec.get("reward")
        data = reward.get("retention") if isinstance(reward, dict) else None
        if data is None:
            raise SparrowError(f"the profile has no reward data (schedule {name!r}); re-run 'sparrow profile' with "
                               "--reward NAME to calibrate with --min-retention")
        if not isinstance(data, dict) or set(data) != set(Retention.__dataclass_fields__) or not all(
                data[k] is None or (isinstance(data[k], (int, float)) and not isinstance(data[k], bool))
                for k in ("value", "low", "high")):
            raise SparrowError(f"schedule {name!r}: reward.retention is {short_repr(data)}; expected the object "
                               "'sparrow profile --reward' writes")
        out[name] = Retention(**data)
    return out


def eligible_schedules(profile: dict, min_retention: float) -> list[str]:
    """The profiled schedules whose retention estimate reaches `min_retention`; a SparrowError naming each
    schedule's retention when none does."""
    if isinstance(min_retention, bool) or not isinstance(min_retention, (int, float)) \
            or not 0.0 < min_retention <= 1.0:
        raise SparrowError(f"min_retention must be in (0, 1], got {min_retention}")
    retention = profile_retention(profile)
    eligible = [n for n, r in retention.items() if r.value is not None and r.value >= min_retention]
    if retention and all(r.value is None for r in retention.values()):
        dense = next(iter(retention.values())).dense_mean
        raise SparrowError(f"the profile's dense policy has mean reward {dense}, so no retention is defined (n/a "
                           "for every schedule) and larger budgets cannot help: profile prompts the dense policy "
                           "solves sometimes, or a reward that scores them, or calibrate without --min-retention")
    if not eligible:
        found = ", ".join(f"{n} {'n/a' if r.value is None else f'{r.value:.3f}'}" for n, r in retention.items())
        raise SparrowError(f"no profiled schedule keeps a reward retention of {min_retention} ({found}); profile "
                           "larger budgets or lower --min-retention")
    return eligible


def retention_floor(profile: dict, min_retention: float, page_size: int = 16) -> str:
    """The cheapest eligible schedule (cost: the sum of its budgets over every profiled length bin)."""
    edges = {(b["start"], b["end"]) for spec in profile["schedules"].values() for b in spec["bins"]}
    schedules = profile["schedules"]
    return min(eligible_schedules(profile, min_retention),
               key=lambda n: sum(offered_budget(schedules[n], s, e, page_size) for s, e in edges))


def _missed_budgets(schedules: dict, need: float, min_tokens: int, page_size: int,
                    least: int) -> dict[int, list[int]]:
    """{bin index: the budgets of every profiled schedule (eligible or not) whose p5 there, on at least
    `min_tokens` tokens, is below `need`}: the evidence that the tail excluded a cheaper budget."""
    out: dict[int, list[int]] = {}
    for spec in schedules.values():
        for b in spec["bins"]:
            if b["count"] >= min_tokens and b["p5"] < need:
                budget = max(offered_budget(spec, b["start"], b["end"], page_size), least)
                out.setdefault(b["bin"], []).append(budget)
    return out


def calibrate(profile: dict, tau: float, margin: float = 0.0, min_tokens: int = 50,
              page_size: int = 16, min_retention: float | None = None,
              unreached: str = "fail") -> tuple[Schedule, list[BinChoice]]:
    """The calibrated schedule and, per bin, what was chosen and why. With `min_retention` only schedules whose
    reward retention estimate reaches it are candidates, and no bin gets less than `retention_floor` gives it.
    A bin where no trusted budget reaches tau + margin fails the calibration (`unreached` "fail") or runs dense
    ("dense": a budget covering the bin, whose acceptance is 1)."""
    if not 0.0 < tau <= 1.0:
        raise SparrowError(f"tau must be in (0, 1], got {tau}")
    if not 0.0 <= margin < 1.0:
        raise SparrowError(f"margin must be in [0, 1), got {margin}")
    if unreached not in UNREACHED_ACTIONS:
        raise SparrowError(f"unknown unreached action {unreached!r}: expected one of {', '.join(UNREACHED_ACTIONS)}")
    check_profile(profile)
    meta = profile.get("meta", {})
    if meta.get("length_origin", "total") != "total":
        raise SparrowError("calibration needs a profile binned by total cached length (--length-origin total), "
                           "the length schedules are keyed by")
    kept = always_kept_pages(meta)
    schedules = profile["schedules"]
    need = tau + margin
    missed = _missed_budgets(schedules, need, min_tokens, page_size, kept * page_size)
    floor = None
    if min_retention is not None:
        floor = schedules[retention_floor(profile, min_retention, page_size)]
        schedules = {n: schedules[n] for n in eligible_schedules(profile, min_retention)}
    choices, tails = _choose(schedules, need, min_tokens, page_size, kept, missed, unreached)
    budgets, running = [], 0
    for i, choice in enumerate(choices):
        least = 0 if floor is None else offered_budget(floor, choice.start, choice.end, page_size)
        final = max(running, choice.budget, least)
        bound = binding_criteria(choice.budget, *tails[i], least, running, final)
        choices[i], running = replace(choice, bound_by=bound), final
        budgets.append(running)
    starts, values = [], []
    for i, (choice, budget) in enumerate(zip(choices, budgets)):
        if values and values[-1] == budget:
            continue
        starts.append(0 if i == 0 else choice.start)
        values.append(budget)
    schedule = Schedule(f"calibrated-{tau:g}", tuple(starts), tuple(values))
    schedule.validate(page_size, kept)  # what every --schedule option will check: refused here, not there
    return schedule, choices


def _choose(schedules: dict, need: float, min_tokens: int, page_size: int, kept: int, missed: dict,
            unreached: str) -> tuple[list[BinChoice], list[tuple[bool, bool]]]:
    """Per bin, the cheapest trusted budget reaching `need` (or dense, with `unreached` "dense"), and per choice
    (whether a cheaper profiled budget missed tau, whether none reached it); a SparrowError naming every bin
    that none reaches otherwise."""
    by_bin: dict[int, list[tuple[int, float, int, str]]] = {}
    edges: dict[int, tuple[int, int]] = {}
    for name, spec in schedules.items():
        for b in spec["bins"]:
            budget = max(offered_budget(spec, b["start"], b["end"], page_size), kept * page_size)
            by_bin.setdefault(b["bin"], []).append((budget, b["p5"], b["count"], name))
            edges[b["bin"]] = (b["start"], b["end"])
    choices, failures, tails = [], [], []
    for k in sorted(by_bin):
        start, end = edges[k]
        trusted = [c for c in by_bin[k] if c[2] >= min_tokens]
        good = sorted(c for c in trusted if c[1] >= need)
        if good:
            budget, p5, count, name = good[0]
            choices.append(BinChoice(start, end, budget, p5, count, name))
            tails.append((any(b < budget for b in missed.get(k, ())), False))
            continue
        if trusted and unreached == "dense":
            best = max(trusted, key=lambda c: c[1])
            choices.append(BinChoice(start, end, max(_round_up(end, page_size), kept * page_size), best[1], best[2],
                                     f"none (best {best[3]})"))
            tails.append((False, True))
        elif trusted:
            best = max(trusted, key=lambda c: c[1])
            largest = max(c[0] for c in trusted)
            failures.append(f"[{start}, {end}): best 5th percentile {best[1]:.4f} ({best[3]}), need {need:.4f}; "
                            f"profile budgets above {largest} (e.g. const:{2 * largest}), or --unreached dense")
        else:
            failures.append(f"[{start}, {end}): fewer than {min_tokens} tokens in every schedule; profile more "
                            "prompts or samples, or lower --min-tokens")
    if failures:
        raise SparrowError("no profiled budget reaches tau in these bins:\n  " + "\n  ".join(failures))
    return choices, tails


def per_length_acceptance(profile: dict, name: str) -> list[tuple[int, float]]:
    """Schedule `name`'s mean alpha per bin of the profile as [(first cached length, mean)], ascending: what
    `exact_cost.exact_decode` takes as a per-length acceptance. Bins of generated positions are placed after the
    profile's mean prompt; empty bins are left out (their neighbours' values reach over them)."""
    meta = profile.get("meta", {})
    offset = 0 if meta.get("length_origin", "total") == "total" else round(meta.get("prompt_tokens_mean", 0))
    bins = sorted((b for b in profile["schedules"][name]["bins"] if b.get("count", 0) > 0 and "mean" in b),
                  key=lambda b: b["start"])
    if not bins:
        raise SparrowError(f"schedule {name!r} of the profile has no bin with tokens and a mean alpha")
    return [(offset + b["start"], float(b["mean"])) for b in bins]


def profiled_schedule(profile: dict, schedule) -> str:
    """The name of the profile's schedule that gives `schedule`'s budgets (a SparrowError listing them if none)."""
    meta = profile.get("meta", {})
    page_size = meta.get("sparse", {}).get("page_size", 16)
    for name, entry in profile["schedules"].items():
        parsed = parse_schedule(entry["spec"], page_size, always_kept_pages(meta))
        if (parsed.starts, parsed.budgets) == (schedule.starts, schedule.budgets):
            return name
    raise SparrowError(f"the profile holds no schedule with the budgets of {schedule.name!r}; it holds "
                       f"{', '.join(profile['schedules'])}")


def exact_candidates(profile: dict, dims, hw, samples: int, max_draft_tokens: int = 16, *,
                     pricing: Pricing = Pricing()) -> list[dict]:
    """Exact mode's predicted decode speedup for every profiled schedule, best first: each schedule's mean
    acceptance per bin of the profile stands for its drafts' per-token acceptance at those lengths, and the cost
    model picks the draft length (`exact_cost.best_draft_tokens`) at the profile's prompt and generation lengths.
    In exact mode the budget only sets speed (rejected drafts cost time, never reward), so no tau applies.
    The profile's schedules are read at `pricing.page_size`."""
    meta = profile.get("meta", {})
    prompt_len = max(1, round(meta.get("prompt_tokens_mean", 1)))
    gen_len = max(1, meta.get("sampling", {}).get("max_new_tokens", 1))
    rows = []
    for name, entry in profile["schedules"].items():
        schedule = parse_schedule(entry["spec"], pricing.page_size, always_kept_pages(meta))
        if schedule.is_dense:
            continue
        best = best_draft_tokens(dims, hw, schedule, prompt_len, gen_len, samples,
                                 per_length_acceptance(profile, name), max_draft_tokens, pricing=pricing)
        rows.append({"schedule": name, **best})
    if not rows:
        raise SparrowError("the profile holds no sparse schedule to draft with")
    return sorted(rows, key=lambda row: -row["exact_over_dense"])
