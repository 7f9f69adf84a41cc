"""The cost model of dense vs sparse rollouts (docs/cost-model.md): exact counts, the paper's formulas, the CLI."""

import dataclasses
import json
import types
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from sparrow.cli import main
from sparrow.errors import SparrowError
from sparrow.measure.cost_model import (
    HARDWARE,
    Hardware,
    ModelDims,
    Pricing,
    compare,
    equal_cost_constant,
    hardware,
    paper_cost,
    prefill_cost,
    seconds,
    trajectory_cost,
)
from sparrow.measure.exact_cost import acceptance_segments, best_draft_tokens, exact_decode, tokens_per_verify
from sparrow.measure.training_cost import training_step
from sparrow.model_shapes import SMOLLM2_135M, model_config, model_dims
from sparrow.schedules import DENSE, const, parse_schedule, steps


def step_cost(dims, hw, batch, cached, budget, page_size, **options):
    """One decode step of `batch` sequences holding `cached` tokens each (the new one included; budget None:
    dense): the decode part of a one-step trajectory."""
    schedule = DENSE if budget is None else const(budget)
    return trajectory_cost(dims, hw, schedule, cached - 1, 1, batch, pricing=Pricing(page_size, **options)).decode

SMALL = ModelDims(layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=259, params=1000,
                  tied_embeddings=True)
TOY_HW = Hardware("toy", peak_flops=100.0, bandwidth=10.0)


def test_smollm2_dims_and_parameter_count():
    dims = ModelDims.from_config(LlamaConfig(**SMOLLM2_135M))
    embed = 49152 * 576
    per_layer = (576 * 576 + 2 * 576 * 192 + 576 * 576) + 3 * 576 * 1536 + 2 * 576
    assert embed + 30 * per_layer + 576 == 134_515_008
    assert dims.params == 134_515_008
    assert dims.kv_width == 30 * 3 * 64 == 5760
    assert dims.gqa_ratio == 3
    assert dims.step_params == dims.params


@pytest.mark.parametrize("name", ["smollm2-135m", "tiny-llama", "tiny-qwen2", "tiny-qwen3", "qwen3-8b"])
def test_parameter_count_matches_the_instantiated_model(name):
    config = model_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert ModelDims.from_config(config).params == sum(p.numel() for p in model.parameters())


def test_qwen3_presets_match_their_published_sizes():
    published = {"qwen3-1.7b": (1.7e9, 1.4e9), "qwen3-4b": (4.0e9, 3.6e9), "qwen3-8b": (8.2e9, 6.95e9),
                 "qwen3-14b": (14.8e9, 13.2e9)}
    for name, (total, non_embedding) in published.items():
        dims = model_dims(name)
        embeddings = dims.vocab * dims.hidden * (1 if dims.tied_embeddings else 2)
        assert dims.params == pytest.approx(total, rel=0.02)
        assert dims.params - embeddings == pytest.approx(non_embedding, rel=0.02)
    assert model_dims("qwen3-8b").step_params == model_dims("qwen3-8b").params - 151936 * 4096


def test_missing_config_field_is_named():
    config = types.SimpleNamespace(num_hidden_layers=2, hidden_size=8, num_attention_heads=2, num_key_value_heads=1,
                                   vocab_size=10)
    with pytest.raises(SparrowError, match="intermediate_size"):
        ModelDims.from_config(config)


def test_head_dim_defaults_to_hidden_over_heads():
    config = types.SimpleNamespace(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=10, head_dim=None)
    assert ModelDims.from_config(config).head_dim == 16


def test_hardware_presets_and_overrides():
    assert HARDWARE["h200"].intensity == pytest.approx(989e12 / 4.8e12)
    assert hardware("H100").bandwidth == 3.35e12
    assert hardware("b200").peak_flops == 2.25e15
    assert hardware("a100", bandwidth=1.935e12) == Hardware("a100", 312e12, 1.935e12)
    assert hardware("cpu", 1e12, 1e11).intensity == pytest.approx(10.0)
    with pytest.raises(SparrowError, match="--peak-flops and --bandwidth"):
        hardware("cpu")
    with pytest.raises(SparrowError, match="--bandwidth"):
        hardware("cpu", peak_flops=1e12)
    with pytest.raises(SparrowError, match="unknown hardware 'tpu'"):
        hardware("tpu")
    assert hardware("h200").step_overhead == 0 and hardware("cpu", 1e12, 1e11, 0.04).step_overhead == 0.04
    for bad in (-0.001, float("nan"), True, "0.1"):
        with pytest.raises(SparrowError, match="step_overhead must be seconds per forward pass"):
            hardware("h100", step_overhead=bad)


def test_every_forward_pass_pays_the_step_overhead():
    # 0.5 s at 100 FLOP/s: 50 equivalent FLOPs per forward pass, on top of the FLOPs and bytes
    slow = Hardware("toy", peak_flops=100.0, bandwidth=10.0, step_overhead=0.5)
    for budget in (None, 64):
        base, with_overhead = (step_cost(SMALL, hw, 2, 100, budget, 16) for hw in (TOY_HW, slow))
        assert with_overhead.forwards == 1 and with_overhead.cost == base.cost + 50
        assert (with_overhead.flops, with_overhead.bytes) == (base.flops, base.bytes)
        assert seconds(with_overhead, slow) == pytest.approx(base.cost / 100 + 0.5)
    total = trajectory_cost(SMALL, slow, const(64), 37, 150, 3)
    assert total.forwards == 151 and total.prefill.forwards == 1  # one prefill, 150 decode steps
    assert total.cost == pytest.approx(trajectory_cost(SMALL, TOY_HW, const(64), 37, 150, 3).cost + 151 * 50)
    # a cost paid by both sides alike brings the predicted speedup toward 1
    dims, cpu = model_dims("smollm2-135m"), hardware("cpu", 1.33e11, 2.44e10)
    args = (const(1024), 8100, 64, 8)
    float32 = Pricing(bytes_per_param=4, bytes_per_kv=4)
    plain = compare(dims, cpu, *args, pricing=float32)
    hosted = compare(dims, hardware("cpu", 1.33e11, 2.44e10, 0.045), *args, pricing=float32)
    assert hosted["dense_step_s"] == pytest.approx(plain["dense_step_s"] + 0.045)
    assert hosted["sparse_step_s"] == pytest.approx(plain["sparse_step_s"] + 0.045)
    assert 1 < hosted["predicted_speedup"] < plain["predicted_speedup"]


def test_step_cost_by_hand():
    # batch 2, 100 cached tokens (7 pages of 16, the last with 4 tokens), budget 64 tokens = 4 pages.
    # 2 dense layers attend 100 tokens; 2 sparse layers attend 4 pages minus the current page's 12 empty
    # slots = 52 tokens and read the centroids of 100 // 16 = 6 full pages. Per KV head-set: 2 heads x 16 dims.
    cost = step_cost(SMALL, TOY_HW, batch=2, cached=100, budget=64, page_size=16)
    tokens_read = 2 * 100 + 2 * 52
    assert cost.weight_bytes == 1000 * 2
    assert cost.kv_bytes == 2 * 2 * 32 * 2 * (tokens_read + 4)  # K and V, 2 bytes, reads + the new token's write
    assert cost.landmark_bytes == 2 * 32 * 2 * 2 * 6
    assert cost.proj_flops == 2 * 1000 * 2
    assert cost.attn_flops == 2 * 4 * 4 * 16 * tokens_read
    assert cost.score_flops == 2 * (2 * 32) * 2 * 6  # group-mean query . centroid, one per KV head
    assert (cost.flops, cost.bytes) == (161_184, 82_384)
    assert cost.cost == 161_184 + 10 * 82_384
    attention = cost.attn_flops + cost.score_flops + 10 * (cost.kv_bytes + cost.landmark_bytes)
    assert cost.attention_share == pytest.approx(attention / cost.cost)

    quest = step_cost(SMALL, TOY_HW, batch=2, cached=100, budget=64, page_size=16, landmark="quest")
    assert quest.landmark_bytes == 2 * cost.landmark_bytes
    assert quest.score_flops == 2 * (4 * 4 * 16) * 2 * 6  # min/max bounds per query head


def test_a_covering_budget_costs_exactly_the_dense_step():
    dense = step_cost(SMALL, TOY_HW, batch=3, cached=100, budget=None, page_size=16)
    assert step_cost(SMALL, TOY_HW, batch=3, cached=100, budget=112, page_size=16) == dense
    assert step_cost(SMALL, TOY_HW, batch=3, cached=100, budget=4096, page_size=16) == dense
    assert step_cost(SMALL, TOY_HW, batch=3, cached=100, budget=96, page_size=16).cost < dense.cost
    assert dense.landmark_bytes == dense.score_flops == 0


def test_cost_rises_with_budget_and_with_page_count():
    dims, hw = model_dims("qwen3-4b"), hardware("h200")
    by_budget = [step_cost(dims, hw, 8, 20_000, b, 16).cost for b in (256, 512, 1024, 2048, 4096)]
    assert by_budget == sorted(by_budget) and len(set(by_budget)) == 5
    by_length = [step_cost(dims, hw, 8, n, 1024, 16) for n in (4_096, 8_192, 16_384, 32_768)]
    assert [c.cost for c in by_length] == sorted(c.cost for c in by_length)
    assert [c.landmark_bytes for c in by_length] == [by_length[0].landmark_bytes * k for k in (1, 2, 4, 8)]
    dense_layer_growth = 8 * 2 * (8 * 128) * 2 * 2  # batch, K and V, 8 KV heads x 128, bytes, dense layers
    assert by_length[1].kv_bytes - by_length[0].kv_bytes == dense_layer_growth * 4_096


def test_budget_below_the_always_kept_pages_is_refused():
    with pytest.raises(SparrowError, match="always-kept"):
        step_cost(SMALL, TOY_HW, batch=1, cached=500, budget=32, page_size=16)


def test_trajectory_is_the_sum_of_its_steps_and_the_prefill():
    schedule = steps(64, [48, 64, 96])
    prompt, gen, n = 37, 150, 3
    total = trajectory_cost(SMALL, TOY_HW, schedule, prompt, gen, n)
    parts = [prefill_cost(SMALL, TOY_HW, prompt)]
    parts += [step_cost(SMALL, TOY_HW, n, prompt + i + 1, schedule.budget_at(prompt + i + 1), 16) for i in range(gen)]
    for name in ("flops", "bytes", "weight_bytes", "kv_bytes", "landmark_bytes", "proj_flops", "attn_flops",
                 "score_flops", "forwards"):
        assert getattr(total, name) == sum(getattr(p, name) for p in parts), name
    assert total.cost == pytest.approx(sum(p.cost for p in parts), rel=1e-12)
    assert total.prefill == parts[0]
    assert (total.steps, total.samples) == (gen, n)


def test_prefill_by_hand():
    pre = prefill_cost(SMALL, TOY_HW, prompt_len=10)
    assert pre.proj_flops == 2 * 1000 * 10
    assert pre.attn_flops == 4 * 4 * 16 * 4 * (10 * 11 // 2)
    assert pre.weight_bytes == 2000 and pre.kv_bytes == 2 * SMALL.kv_width * 10 * 2


def test_compare_and_a_covering_schedule():
    dims, hw = model_dims("smollm2-135m"), hardware("h200")
    covering = compare(dims, hw, const(4096), 256, 3000, 8)
    assert covering["predicted_speedup"] == 1.0
    assert covering["dense_cost"] == covering["sparse_cost"]
    result = compare(dims, hw, parse_schedule("qwen3-4b-0.86"), 256, 32_768, 8)
    assert result["predicted_speedup"] == pytest.approx(result["dense_cost"] / result["sparse_cost"])
    assert result["predicted_speedup"] > 2
    assert 0 < result["sparse_attention_share"] < result["dense_attention_share"] < 1
    with pytest.raises(SparrowError, match="nothing to compare"):
        compare(dims, hw, DENSE, 256, 100, 8)


def test_attention_share_of_dense_cost_falls_as_models_grow():
    hw, shares = hardware("h200"), []
    for name in ("qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b"):
        shares.append(trajectory_cost(model_dims(name), hw, DENSE, 256, 32_768, 8).attention_share)
    assert shares == sorted(shares, reverse=True)
    assert shares[0] > 0.75 and shares[-1] < 0.5


def test_at_equal_token_budget_larger_pages_cost_less():
    # The paper's finding that page size 16 is best is about cost at equal *accuracy*: smaller pages select
    # more precisely, so they reach a target acceptance rate with fewer tokens. At the same token budget,
    # the only cost that depends on the page size is the landmark traffic (one landmark per page), which
    # shrinks as pages grow; docs/cost-model.md works out how much larger a budget bigger pages may use.
    dims, hw, schedule = model_dims("qwen3-4b"), hardware("h200"), parse_schedule("qwen3-4b-0.86")
    costs = {ps: trajectory_cost(dims, hw, schedule, 256, 32_768, 8, pricing=Pricing(page_size=ps))
             for ps in (16, 32, 64, 128)}
    assert [costs[ps].cost for ps in (16, 32, 64, 128)] == sorted((c.cost for c in costs.values()), reverse=True)
    decode_landmarks = {ps: c.decode.landmark_bytes for ps, c in costs.items()}
    assert decode_landmarks[16] / decode_landmarks[32] == pytest.approx(2, rel=0.01)
    kv = [costs[ps].kv_bytes for ps in (16, 32, 64, 128)]
    assert kv == sorted(kv, reverse=True) and kv[-1] / kv[0] > 0.98  # the current page's empty slots
    saving = 1 - costs[32].cost / costs[16].cost
    assert 0.01 < saving < 0.05


def test_paper_formulas_by_hand():
    dims = ModelDims(layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10, params=1000,
                     tied_embeddings=True)
    result = paper_cost(dims, TOY_HW, budget=32, prompt_len=10, gen_len=20, samples=3, page_size=16)
    # P 1000, N 3, D 8, r 2, I 10, B 32, L_in 10, L_out 20, ps 16
    dense = 2 * 1000 * 3 * 20 + 2 * (2 * 10 + 20) * 20 * 3 * 8 + 10 * (2 * 10 * 20 * 8 + 3 * 20 ** 2 * 8)
    without_scoring = 2 * 3 * 1000 * 20 + 2 * 2 * 3 * 8 * 32 * 20 + 2 * 10 * 3 * 8 * 32 * 20
    scoring = 2 * 3 * 10 * 8 * 20 + 2 * 3 * 8 * 400 / 32 + 2 * 10 * 10 * 8 * 20 + 10 * 3 * 8 * 400 / 32
    assert (dense, without_scoring, scoring) == (286_400, 488_640, 45_200)
    assert result == {"dense": 286_400, "sparse": 533_840, "speedup": 286_400 / 533_840}


def _run(argv, capsys):
    code = main(["cost", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_json(capsys):
    code, out, _ = _run(["--model", "qwen3-4b", "--schedule", "qwen3-4b-0.86", "--prompt-len", "256",
                         "--gen-len", "32768", "--samples", "8", "--page-sizes", "16,32,64,128", "--json"], capsys)
    assert code == 0
    report = json.loads(out)
    assert {"dense_cost", "sparse_cost", "predicted_speedup", "dense_attention_share", "sparse_attention_share",
            "page_sizes", "paper"} <= set(report)
    assert report["predicted_speedup"] == pytest.approx(report["dense_cost"] / report["sparse_cost"])
    assert [r["page_size"] for r in report["page_sizes"]] == [16, 32, 64, 128]
    assert report["page_sizes"][0]["sparse_cost"] == report["sparse_cost"]
    assert report["paper"]["budget"] == 6144 and report["paper"]["speedup"] > 1
    assert report["hardware"]["name"] == "h200"


def test_cli_table_and_skipped_page_sizes(capsys):
    code, out, _ = _run(["--model", "tiny-qwen3", "--schedule", "const:80", "--gen-len", "500",
                         "--page-sizes", "16,32"], capsys)
    assert code == 0
    assert "predicted speedup" in out and "paper formula" in out
    assert "skipped" in out and "multiple of the page size 32" in out


def test_cli_reads_a_local_config_directory(tmp_path, capsys):
    LlamaConfig(**SMOLLM2_135M).save_pretrained(tmp_path)
    code, out, _ = _run(["--model", str(tmp_path), "--schedule", "const:1024", "--gen-len", "4000", "--hardware",
                         "cpu", "--peak-flops", "1e12", "--bandwidth", "5e10", "--json"], capsys)
    assert code == 0
    report = json.loads(out)
    assert report["params"] == 134_515_008 and report["hardware"]["intensity"] == pytest.approx(20.0)
    assert report["hardware"]["step_overhead"] == 0
    code, out, _ = _run(["--model", str(tmp_path), "--schedule", "const:1024", "--gen-len", "4000", "--hardware",
                         "cpu", "--peak-flops", "1e12", "--bandwidth", "5e10", "--step-overhead", "0.04"], capsys)
    dense_ms = (report["dense"]["decode"]["cost"] / 1e12 / 4000 + 0.04) * 1e3
    assert code == 0 and "40 ms per forward pass" in out and f"mean decode step: dense {dense_ms:.3g} ms" in out


def test_cli_takes_the_machine_as_a_yaml_section_or_flat(tmp_path, capsys):
    """cost, calibrate and bench share one machine section: nested or flat YAML and the flags give one report."""
    nested, flat = tmp_path / "nested.yaml", tmp_path / "flat.yaml"
    nested.write_text("schedule: const:1024\nmachine: {hardware: cpu, peak_flops: 1.0e+12, bandwidth: 5.0e+10, "
                      "step_overhead: 0.01, kv_bytes: 4}\n")
    flat.write_text("schedule: const:1024\nhardware: cpu\npeak_flops: 1.0e+12\nbandwidth: 5.0e+10\n"
                    "step_overhead: 0.01\nkv_bytes: 4\n")
    flags = ["--schedule", "const:1024", "--hardware", "cpu", "--peak-flops", "1e12", "--bandwidth", "5e10",
             "--step-overhead", "0.01", "--kv-bytes", "4"]
    reports = []
    for argv in (["--config", str(nested)], ["--config", str(flat)], flags):
        code, out, _ = _run([*argv, "--json"], capsys)
        assert code == 0
        reports.append(json.loads(out))
    assert reports[0] == reports[1] == reports[2]
    assert reports[0]["hardware"] == {"name": "cpu", "peak_flops": 1e12, "bandwidth": 5e10, "intensity": 20.0,
                                      "step_overhead": 0.01}
    code, out, _ = _run(flags[:-2] + ["--json"], capsys)  # kv_bytes 2: half the cache bytes
    assert json.loads(out)["dense"]["decode"]["kv_bytes"] * 2 == reports[0]["dense"]["decode"]["kv_bytes"]


@pytest.mark.parametrize("argv, message", [
    (["--model", "smollm2-135m", "--schedule", "const:512", "--hardware", "cpu"], "--peak-flops and --bandwidth"),
    (["--model", "nope", "--schedule", "const:512"], "unknown model 'nope'"),
    (["--model", "smollm2-135m", "--schedule", "dense"], "nothing to compare"),
    (["--model", "smollm2-135m"], "give --schedule"),
    (["--model", "smollm2-135m", "--schedule", "const:512", "--dense-layers", "0,40"], "out of range"),
    (["--model", "smollm2-135m", "--schedule", "const:512", "--step-overhead", "-1"],
     "step_overhead must be seconds per forward pass from 0 to 3600, got -1.0"),
    (["--model", "smollm2-135m", "--schedule", "const:512", "--prompt-lens", "1000,0"],
     "prompt_lens must be one or more lengths from 1 to 10,000,000 tokens, got '1000,0'"),
])
def test_cli_errors(argv, message, capsys):
    code, _, err = _run(argv, capsys)
    assert code == 2
    assert message in err and "Traceback" not in err


def test_step_cost_is_a_frozen_record():
    cost = step_cost(SMALL, TOY_HW, 1, 10, None, 16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cost.flops = 0


@pytest.mark.parametrize("settings, message", [
    ({"page_size": 0}, "page size must be a positive integer, got 0"),
    ({"dense_layers": 5}, "dense_layers must be between 0 and the model's 4 layers, got 5"),
    ({"landmark": "mean"}, "unknown landmark 'mean'"),
    ({"bytes_per_param": 0}, "bytes_per_param must be a positive finite number, got 0"),
    ({"bytes_per_kv": float("inf")}, "bytes_per_kv must be a positive finite number, got inf"),
])
def test_every_pricing_function_refuses_what_the_model_cannot_price(settings, message):
    pricing = Pricing(**settings)
    with pytest.raises(SparrowError, match=message):
        pricing.check(SMALL)
    args = (SMALL, TOY_HW, const(64), 100, 20, 2)
    for price in (lambda: trajectory_cost(*args, pricing=pricing), lambda: compare(*args, pricing=pricing),
                  lambda: equal_cost_constant(SMALL, TOY_HW, const(64), [100, 200], 20, 2, pricing=pricing),
                  lambda: exact_decode(*args, 0.9, 2, pricing=pricing),
                  lambda: training_step(*args, pricing=pricing)):
        with pytest.raises(SparrowError, match=message):
            price()
    with pytest.raises(dataclasses.FrozenInstanceError):
        pricing.page_size = 16


def test_the_equal_cost_constant_matches_a_growing_schedule_over_mixed_lengths(capsys):
    dims, hw = model_dims("smollm2-135m"), hardware("h200")
    lengths, growing = [1000, 3000, 5000, 7000], parse_schedule("0:1024,4096:2048")

    def total(schedule):
        return sum(trajectory_cost(dims, hw, schedule, n, 300, 8).cost for n in lengths)

    budget, ratio = equal_cost_constant(dims, hw, growing, lengths, 300, 8)
    assert budget % 16 == 0 and ratio == pytest.approx(total(const(budget)) / total(growing))
    # no other page count comes closer: one page less costs too little, one more too much
    assert total(const(budget - 16)) < total(growing) < total(const(budget + 16))
    assert abs(ratio - 1) <= abs(total(const(budget + 16)) / total(growing) - 1)
    assert equal_cost_constant(dims, hw, const(1024), lengths, 300, 8) == (1024, 1.0)  # a constant is its own match
    code, out, _ = _run(["--schedule", "0:1024,4096:2048", "--prompt-lens", "1000,3000,5000,7000", "--gen-len",
                         "300", "--json"], capsys)
    assert code == 0 and json.loads(out)["equal_cost_constant"]["budget"] == budget


def test_exact_mode_rounds_commit_the_geometric_sum_of_acceptances():
    assert tokens_per_verify(1.0, 4) == 5 and tokens_per_verify(0.0, 4) == 1
    assert tokens_per_verify(0.5, 2) == pytest.approx(1.75)
    with pytest.raises(SparrowError, match="acceptance must be in"):
        tokens_per_verify(1.2, 2)


def test_exact_decode_prices_k_drafts_and_one_span_verification():
    dims, hw = model_dims("smollm2-135m"), hardware("h200")
    args = (dims, hw, const(1024), 8000, 512, 8)
    sparse = trajectory_cost(dims, hw, const(1024), 8000, 512, 8).decode
    dense = trajectory_cost(dims, hw, DENSE, 8000, 512, 8).decode
    perfect = exact_decode(*args, acceptance=1.0, draft_tokens=4)
    # the span step reads weights and K/V once but pays every token's FLOPs
    verify = dense.cost + 4 * (dense.proj_flops + dense.attn_flops)
    assert perfect["exact_decode_cost"] == pytest.approx((4 * sparse.cost + verify) / 5)
    assert perfect["exact_over_dense"] < perfect["sparse_over_dense"]  # never faster than pure sparse decode
    assert exact_decode(*args, acceptance=0.0, draft_tokens=4)["exact_over_dense"] < 1  # every draft wasted
    slow = hardware("h200", step_overhead=1e-3)  # one overhead per draft and one per verification
    sparse_slow = trajectory_cost(dims, slow, const(1024), 8000, 512, 8).decode
    dense_slow = trajectory_cost(dims, slow, DENSE, 8000, 512, 8).decode
    assert sparse_slow.cost == pytest.approx(sparse.cost + 512 * slow.overhead_flops)
    assert exact_decode(dims, slow, *args[2:], acceptance=1.0, draft_tokens=4)["exact_decode_cost"] == pytest.approx(
        (4 * sparse_slow.cost + dense_slow.cost + 4 * (dense.proj_flops + dense.attn_flops)) / 5)
    best = best_draft_tokens(*args, acceptance=0.9)
    assert all(exact_decode(*args, acceptance=0.9, draft_tokens=k)["exact_over_dense"] <= best["exact_over_dense"]
               for k in range(1, 17))


def test_vllms_drafter_copy_pays_a_second_dense_span_per_round_for_its_first_draft():
    """vLLM's draft model has a cache of its own: each round its first pass rewrites the K+1 verified tokens densely
    (priced as a second verification) and draws the first draft, then K-1 sparse steps; our engine's drafts are
    K sparse steps. So, per round, copy = shared + verification - one sparse step."""
    dims, hw = model_dims("qwen3-4b"), hardware("h100")
    args = (dims, hw, const(2048), 32768, 1024, 32)
    sparse = trajectory_cost(dims, hw, const(2048), 32768, 1024, 32).decode
    dense = trajectory_cost(dims, hw, DENSE, 32768, 1024, 32).decode
    for k, a in ((1, 0.9), (4, 0.8)):
        verify = dense.cost + k * (dense.proj_flops + dense.attn_flops)
        shared = exact_decode(*args, acceptance=a, draft_tokens=k)
        copy = exact_decode(*args, acceptance=a, draft_tokens=k, drafter="copy")
        rounds = tokens_per_verify(a, k)
        assert shared["exact_decode_cost"] == pytest.approx((k * sparse.cost + verify) / rounds)
        assert copy["exact_decode_cost"] == pytest.approx(((k - 1) * sparse.cost + 2 * verify) / rounds)
        assert copy["exact_over_dense"] < shared["exact_over_dense"]
    with pytest.raises(SparrowError, match="drafter 'twin'"):
        exact_decode(*args, acceptance=0.9, draft_tokens=2, drafter="twin")


def test_exact_decode_prices_each_stretch_of_lengths_at_its_own_acceptance():
    dims, hw = model_dims("smollm2-135m"), hardware("h200")
    args = (dims, hw, const(1024), 4000, 1000, 8)
    assert acceptance_segments(0.9, 4000, 1000) == [(0, 1000, 0.9)]
    # step i holds 4001 + i tokens: 4500 is first reached at step 499, 9000 never
    assert acceptance_segments([(0, 0.9), (4500, 0.5), (9000, 0.1)], 4000, 1000) == [(0, 499, 0.9), (499, 501, 0.5)]
    assert acceptance_segments([(6000, 0.7)], 4000, 1000) == [(0, 1000, 0.7)]  # below the first: the first's
    same = exact_decode(*args, acceptance=[(0, 0.9), (4500, 0.9)], draft_tokens=4)
    assert same == pytest.approx(exact_decode(*args, acceptance=0.9, draft_tokens=4))
    # a tail that accepts less is slower than its mean spread evenly, and the mean is weighted by steps
    split = exact_decode(*args, acceptance=[(0, 1.0), (4501, 0.2)], draft_tokens=4)
    assert split["acceptance"] == pytest.approx((500 * 1.0 + 500 * 0.2) / 1000)
    assert split["tokens_per_verify"] == pytest.approx(1000 / (500 / 5 + 500 / tokens_per_verify(0.2, 4)))
    assert split["exact_over_dense"] < exact_decode(*args, acceptance=0.6, draft_tokens=4)["exact_over_dense"]
    for bad, message in (([], "at least one"), ([(10, 0.9), (5, 0.8)], "must ascend in cached length, got 10 then 5"),
                         ([(0, 1.5)], "acceptance from 0 cached tokens must be a finite number")):
        with pytest.raises(SparrowError, match=message):
            acceptance_segments(bad, 4000, 1000)


def test_cost_command_prices_exact_mode_from_a_profiles_bins(capsys):
    base = ["cost", "--schedule", "const:1024", "--prompt-len", "3420", "--gen-len", "1300", "--json"]
    assert main(base + ["--acceptance-profile", "examples/longanswer-reward-profile.json"]) == 0
    report = json.loads(capsys.readouterr().out)["exact"]
    profile = json.loads(Path("examples/longanswer-reward-profile.json").read_text())
    assert report["per_length"] == [[b["start"], b["mean"]] for b in profile["schedules"]["const:1024"]["bins"]]
    assert 0.9 < report["acceptance"] < 1 and report["exact_over_dense"] > 1
    assert main(base + ["--acceptance", "0.9", "--acceptance-profile", "examples/longanswer-reward-profile.json"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["cost", "--schedule", "const:512", "--acceptance-profile",
                 "examples/longanswer-reward-profile.json"]) == 2
    assert "no schedule with the budgets of 'const:512'" in capsys.readouterr().err
    assert main(["cost", "--schedule", "const:1024", "--acceptance-profile", "missing.json"]) == 2


def test_cost_command_prices_exact_mode(capsys):
    assert main(["cost", "--schedule", "const:1024", "--prompt-len", "8000", "--gen-len", "512", "--acceptance",
                 "0.95", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert 1 <= report["exact"]["draft_tokens"] <= 16 and report["exact"]["exact_over_dense"] > 1
    assert main(["cost", "--schedule", "const:1024", "--draft-tokens", "4"]) == 2
    assert "needs --acceptance" in capsys.readouterr().err


def test_a_training_step_prices_the_update_both_pay_and_the_monitor_only_sparse_rollouts_pay(capsys):
    dims, hw = model_dims("smollm2-135m"), hardware("h200")
    prompt, gen, n = 2000, 300, 3
    step = training_step(dims, hw, const(64), prompt, gen, n, monitor_every=2, monitor_share=0.5)
    pair = 4 * dims.heads * dims.head_dim
    sum_cached = sum(prompt + i + 1 for i in range(gen))
    # forward and backward: three forwards over the prompt (no logits) and every completion token
    forward_proj = 2 * (dims.step_params - dims.vocab * dims.hidden) * prompt + 2 * dims.step_params * n * gen
    forward_attn = pair * dims.layers * (prompt * (prompt + 1) // 2 + n * sum_cached)
    assert step["update"]["proj_flops"] == 3 * forward_proj and step["update"]["attn_flops"] == 3 * forward_attn
    # the monitor: ceil(0.5 * 3) = 2 completions teacher-forced, each token attending what it did while decoding
    attended = sum(min(prompt + i + 1, 64 - (-(prompt + i + 1) % 16)) for i in range(gen))
    assert step["monitor_rows"] == 2
    assert step["monitor"]["proj_flops"] == 2 * dims.step_params * 2 * gen
    assert step["monitor"]["attn_flops"] == 2 * pair * (2 * sum_cached + (dims.layers - 2) * attended)
    dense = trajectory_cost(dims, hw, DENSE, prompt, gen, n).cost
    sparse = trajectory_cost(dims, hw, const(64), prompt, gen, n).cost
    update, monitor = step["update_cost"], step["monitor_cost"]
    assert step["step_speedup"] == pytest.approx((dense + update) / (sparse + update + monitor / 2))
    assert step["step_speedup_limit"] == pytest.approx((dense + update) / update)
    assert 1 < step["step_speedup"] < step["rollout_speedup"] < step["step_speedup_limit"]
    # a covering budget decodes densely: the monitor only costs, so the sparse step is the slower one
    covering = training_step(dims, hw, const(4096), prompt, gen, n)
    assert covering["rollout_speedup"] == 1 and covering["step_speedup"] < 1
    assert covering["monitor"]["attn_flops"] == pair * dims.layers * n * sum_cached
    with pytest.raises(SparrowError, match="monitor_share must be in"):
        training_step(dims, hw, const(64), prompt, gen, n, monitor_share=0)
    assert main(["cost", "--schedule", "const:1024", "--prompt-len", "3000", "--gen-len", "2000", "--training",
                 "--monitor-every", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["training"]["monitor_every"] == 2 and report["training"]["step_speedup"] > 1
    assert main(["cost", "--schedule", "const:1024", "--training"]) == 0
    assert "GRPO step (rollout + update" in capsys.readouterr().out
