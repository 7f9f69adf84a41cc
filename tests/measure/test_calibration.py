"""Schedule calibration from profiles: cheapest budget per bin reaching tau, non-decreasing, clear failures."""

import json
from pathlib import Path

import pytest

from sparrow.errors import SparrowError
from sparrow.measure.calibration import calibrate


def _profile(table, bin_size=1000, counts=500):
    """table: {budget: [p5 of bin 0, bin 1, ...]} for const schedules (None budget = dense)."""
    schedules = {}
    for budget, p5s in table.items():
        name = "dense" if budget is None else f"const:{budget}"
        schedules[name] = {
            "budgets": [] if budget is None else [{"start": 0, "kv_budget": budget}],
            "bins": [{"bin": k, "start": k * bin_size, "end": (k + 1) * bin_size, "count": counts, "p5": p}
                     for k, p in enumerate(p5s) if p is not None],
        }
    return {"meta": {"length_origin": "total", "bin_size": bin_size}, "schedules": schedules}


def test_the_cheapest_budget_reaching_tau_is_chosen_per_bin_and_kept_non_decreasing():
    profile = _profile({
        256: [0.90, 0.84, 0.80, 0.88],   # bin 3 is noisy-high: monotonicity must not drop back to 256
        512: [0.95, 0.87, 0.83, 0.89],
        1024: [0.99, 0.93, 0.90, 0.86],
    })
    schedule, choices = calibrate(profile, tau=0.86)
    assert [c.budget for c in choices] == [256, 512, 1024, 256]
    assert schedule.starts == (0, 1000, 2000) and schedule.budgets == (256, 512, 1024)
    assert schedule.budget_at(3500) == 1024


def test_margin_asks_for_more_headroom():
    profile = _profile({256: [0.87, 0.87], 512: [0.95, 0.92]})
    assert calibrate(profile, 0.86)[0].budgets == (256,)
    assert calibrate(profile, 0.86, margin=0.02)[0].budgets == (512,)


def test_bins_with_too_few_tokens_are_not_trusted():
    profile = _profile({256: [0.9, 0.9], 512: [0.95, 0.95]})
    profile["schedules"]["const:256"]["bins"][1]["count"] = 10
    assert calibrate(profile, 0.86, min_tokens=50)[0].budgets == (256, 512)


def test_dense_in_a_bin_becomes_a_budget_covering_that_bin():
    profile = _profile({256: [0.9, 0.5], None: [1.0, 1.0]})
    schedule, _ = calibrate(profile, 0.86)
    assert schedule.budgets == (256, 2000)


def test_unreachable_bins_are_named_with_what_to_add():
    profile = _profile({256: [0.9, 0.7, 0.6], 512: [0.95, 0.8, 0.7]})
    with pytest.raises(SparrowError) as err:
        calibrate(profile, 0.86)
    message = str(err.value)
    assert "[1000, 2000)" in message and "[2000, 3000)" in message and "[0, 1000)" not in message
    assert "const:1024" in message


@pytest.mark.parametrize("tau, margin, match", [(0, 0, "tau"), (1.5, 0, "tau"), (0.8, -0.1, "margin")])
def test_bad_arguments(tau, margin, match):
    with pytest.raises(SparrowError, match=match):
        calibrate(_profile({256: [0.9]}), tau, margin)


def test_a_profile_binned_by_generated_position_is_refused():
    profile = _profile({256: [0.9]})
    profile["meta"]["length_origin"] = "generated"
    with pytest.raises(SparrowError, match="total cached length"):
        calibrate(profile, 0.86)


def test_the_long_demo_schedule_is_the_reward_aware_calibration_of_its_shipped_profile():
    """examples/smollm2-manifest.yaml's schedule is what `sparrow calibrate` picks from the committed reward
    profile at the config's tau with a 0.02 margin and its min_retention; the older p5-only profile
    (examples/manifest-profile.json) at that tau and margin asked for 1024 tokens, and 512 without the margin."""
    import torch
    import yaml

    from sparrow.schedules import parse_schedule

    config = yaml.safe_load(Path("examples/smollm2-manifest.yaml").read_text())
    profile = json.loads(Path("examples/manifest-reward-profile.json").read_text())
    schedule, _ = calibrate(profile, config["monitor"]["tau"], margin=0.02,
                            min_retention=config["monitor"]["min_retention"])
    shipped = parse_schedule(config["sparse"]["schedule"])
    lengths = torch.arange(4096, 5120, 16)
    assert torch.equal(schedule.budget_for(lengths), shipped.budget_for(lengths))
    assert shipped.budget_for(torch.tensor([4700])).item() == 3072
    old = json.loads(Path("examples/manifest-profile.json").read_text())
    assert calibrate(old, config["monitor"]["tau"], margin=0.02)[0].budget_for(torch.tensor([4700])).item() == 1024
    _, choices = calibrate(old, 0.75)
    assert [c.budget for c in choices] == [512]


def test_the_shipped_reward_profile_calibrates_to_3072_tokens_for_a_retention_of_09():
    """examples/manifest-reward-profile.json (Intel, 2026-12-02): on the long task p5 holds tau 0.75 from 1024
    tokens and 0.86 from 2048, but only 3072 keeps 90% of the dense reward."""
    profile = json.loads(Path("examples/manifest-reward-profile.json").read_text())
    assert calibrate(profile, 0.75, margin=0.02)[0].budgets == (1024,)
    assert calibrate(profile, 0.86)[0].budgets == (2048,)
    assert calibrate(profile, 0.75, margin=0.02, min_retention=0.9)[0].budgets == (3072,)


def test_the_long_answer_profile_at_a_lower_tau_takes_2048_for_its_reward_floor():
    """examples/longanswer-reward-profile.json (BENCHMARKS, "The long-answer regime", re-measured 2026-12-06): 1024
    tokens keep 0.763 of the dense reward's point estimate, below the 0.9 floor, and their p5 misses tau 0.75 + 0.02
    from 3584 cached tokens on, so the calibration at that lower tau picks 2048 (0.996). The tail alone would keep 1024
    in the first bin; a floor of 0.7 would take 1024 at a low tau."""
    profile = json.loads(Path("examples/longanswer-reward-profile.json").read_text())
    schedule, _ = calibrate(profile, 0.75, margin=0.02, min_retention=0.9)
    assert schedule.budgets == (2048,)
    assert calibrate(profile, 0.75, margin=0.02)[0].budgets == (1024, 2048)
    assert calibrate(profile, 0.5, min_retention=0.9)[0].budgets == (2048,)
    assert calibrate(profile, 0.5, min_retention=0.7)[0].budgets == (1024,)


def test_the_long_answer_profile_at_the_papers_tau_needs_the_whole_cache_at_3_5_to_4k_tokens():
    """examples/longanswer-reward-profile.json at tau 0.86 with the 0.9 reward floor (BENCHMARKS, "The long-answer
    regime"): 2048 tokens reach 0.86 in every bin but [3584, 4096) (p5 0.824 on 3930 tokens), where no profiled
    budget does; run dense there, the non-decreasing rule keeps 4096 for the longer bins. At 0.80 the floor's 2048
    stands everywhere, as at 0.75 + 0.02. examples/smollm2-longanswer.yaml starts its adaptive schedule there."""
    import yaml

    from sparrow.schedules import parse_schedule
    profile = json.loads(Path("examples/longanswer-reward-profile.json").read_text())
    with pytest.raises(SparrowError, match=r"\[3584, 4096\): best 5th percentile 0.8244"):
        calibrate(profile, 0.86, min_retention=0.9)
    schedule, choices = calibrate(profile, 0.86, min_retention=0.9, unreached="dense")
    assert schedule.starts == (0, 3584) and schedule.budgets == (2048, 4096)
    assert [c.bound_by for c in choices] == ["tau + reward floor", "dense: tau unreached", "non-decreasing",
                                             "non-decreasing"]
    config = yaml.safe_load(Path("examples/smollm2-longanswer.yaml").read_text())
    assert config["monitor"]["tau"] == 0.86 and config["sparse"]["schedule"] == "adaptive"
    start = parse_schedule(config["adaptive"]["start"])
    assert (start.starts, start.budgets) == (schedule.starts, schedule.budgets)
    schedule, choices = calibrate(profile, 0.80, min_retention=0.9)
    assert schedule.budgets == (2048,)
    assert [c.bound_by for c in choices] == ["tau + reward floor", "tau + reward floor", "reward floor",
                                             "reward floor"]


def test_exact_mode_calibration_picks_the_fastest_predicted_schedule_and_draft_length(tmp_path, capsys):
    from sparrow.cli import main
    from sparrow.measure.calibration import exact_candidates, per_length_acceptance
    from sparrow.measure.cost_model import Pricing, hardware
    from sparrow.measure.exact_cost import exact_decode
    from sparrow.model_shapes import model_dims
    from sparrow.schedules import parse_schedule

    profile = json.loads(Path("examples/manifest-profile.json").read_text())
    dims, hw = model_dims("smollm2-135m"), hardware("h200")
    rows = exact_candidates(profile, dims, hw, samples=8)
    assert len(rows) == len(profile["schedules"]) - ("dense" in profile["schedules"])
    assert rows == sorted(rows, key=lambda r: -r["exact_over_dense"])
    best = rows[0]
    meta = profile["meta"]
    again = exact_decode(dims, hw, parse_schedule(profile["schedules"][best["schedule"]]["spec"]),
                         round(meta["prompt_tokens_mean"]), meta["sampling"]["max_new_tokens"], 8,
                         per_length_acceptance(profile, best["schedule"]), best["draft_tokens"])
    assert again["exact_over_dense"] == pytest.approx(best["exact_over_dense"])
    out = tmp_path / "exact.json"
    assert main(["calibrate", "--profile", "examples/manifest-profile.json", "--rollout-mode", "exact",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"--draft-tokens {best['draft_tokens']}" in printed
    assert parse_schedule(str(out)).budgets
    # on a CPU, float32 and the host time of every forward pass: a slower prediction, the same numbers printed
    cpu = ["--hardware", "cpu", "--peak-flops", "1.33e11", "--bandwidth", "2.44e10", "--param-bytes", "4",
           "--kv-bytes", "4"]
    float32 = Pricing(bytes_per_param=4, bytes_per_kv=4)
    plain, hosted = (exact_candidates(profile, dims, hardware("cpu", 1.33e11, 2.44e10, overhead), samples=8,
                                      pricing=float32)[0] for overhead in (0.0, 0.045))
    assert hosted["exact_over_dense"] < plain["exact_over_dense"]
    assert main(["calibrate", "--profile", "examples/manifest-profile.json", "--rollout-mode", "exact", *cpu,
                 "--step-overhead", "0.045", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"{hosted['exact_over_dense']:>11.2f}x" in printed and f"--draft-tokens {hosted['draft_tokens']}" in printed
    assert "predicted slower than dense" not in printed
    # memory so fast and arithmetic so slow that a verification costs more than the dense steps it replaces
    slow = ["--hardware", "cpu", "--peak-flops", "1e10", "--bandwidth", "1e12", "--param-bytes", "4", "--kv-bytes", "4"]
    worst = exact_candidates(profile, dims, hardware("cpu", 1e10, 1e12), samples=8, pricing=float32)[0]
    assert worst["exact_over_dense"] < 1
    assert main(["calibrate", "--profile", "examples/manifest-profile.json", "--rollout-mode", "exact", *slow,
                 "--out", str(out)]) == 0
    assert (f"exact mode is predicted slower than dense decoding (best {worst['exact_over_dense']:.2f}x)"
            in capsys.readouterr().out)
    assert main(["calibrate", "--profile", "examples/manifest-profile.json", *cpu[:6], "--kv-bytes", "0"]) == 2
    assert "kv_bytes must be a finite number > 0 and <= 64, got 0.0" in capsys.readouterr().err
    assert main(["calibrate", "--profile", "examples/manifest-profile.json", "--rollout-mode", "exact",
                 "--min-retention", "0.9"]) == 2
    assert "takes no --min-retention" in capsys.readouterr().err


def test_exact_mode_prices_each_length_bin_at_its_own_acceptance():
    from sparrow.measure.calibration import per_length_acceptance, profiled_schedule
    from sparrow.schedules import const

    profile = json.loads(Path("examples/longanswer-reward-profile.json").read_text())
    bins = profile["schedules"]["const:1024"]["bins"]
    assert per_length_acceptance(profile, "const:1024") == [(b["start"], b["mean"]) for b in bins if b["count"]]
    assert profiled_schedule(profile, const(2048)) == "const:2048"
    with pytest.raises(SparrowError, match=r"no schedule with the budgets of 'const:512'; it holds const:1024, const"):
        profiled_schedule(profile, const(512))
    generated = {**profile, "meta": {**profile["meta"], "length_origin": "generated"}}
    offset = round(profile["meta"]["prompt_tokens_mean"])
    assert per_length_acceptance(generated, "const:1024")[0] == (offset + bins[0]["start"], bins[0]["mean"])
