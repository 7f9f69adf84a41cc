"""Bad option values, devices and files: each ends as tests/cli/test_bad_input.py requires (exit code 2, one line
`sparrow CMD: error: ...`, no traceback), refused before any model is loaded where the value is known then."""

import argparse
import json
import os
from pathlib import Path

import pytest
import torch

from sparrow import models
from sparrow.errors import SparrowError
from sparrow.measure.cost_model import trajectory_cost
from sparrow.model_shapes import model_dims
from sparrow.schedules import parse_schedule
from tests.cli.test_bad_input import check_refused, no_model_loading  # noqa: F401 (the fixture)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bad-values")
    for name, message in {"no-role": {"content": "hi"}, "int-content": {"role": "user", "content": 7},
                          "list-content": {"role": "user", "content": ["hi"]}}.items():
        (root / f"{name}.jsonl").write_text(json.dumps({"prompt": [message]}) + "\n")
    (root / "data.jsonl").write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "answer": str(i + 1)}) + "\n"
                                             for i in range(4)))
    (root / "rewards.py").write_text("def one_value(prompts, completions, **kw):\n    return [1.0]\n\n"
                                     "def nan(prompts, completions, **kw):\n    return [float('nan')] * len(prompts)\n")
    (root / "exits.py").write_text("import sys\nsys.exit(3)\n\ndef f(prompts, completions, **kw):\n"
                                   "    return [0.0] * len(completions)\n")
    (root / "shapeless").mkdir()
    (root / "shapeless" / "config.json").write_text('{"model_type": "llama"}')
    (root / "profile.json").write_text("{}")
    for name, data in {"topk": {"bins": [{"start": 0, "kv_budget": 64, "topk": 1}]},
                       "colour": {"colour": "red", "bins": [{"start": 0, "kv_budget": 64}]},
                       "no-bins": {"bins": []}, "huge-budget": [{"start": 0, "kv_budget": 16 * 10**18}],
                       "far-start": [{"start": 0, "kv_budget": 64}, {"start": 10**30, "kv_budget": 128}]}.items():
        (root / f"{name}.json").write_text(json.dumps(data))
    bins = [{"bin": 0, "start": 0, "end": 256, "count": 100, "p5": 0.95, "mean": 0.97}]
    retention = {"value": 0.9, "low": 0.8, "high": 1.0, "sparse_mean": 0.45, "dense_mean": 0.5, "pairs": 8,
                 "prompts": 4}
    for name, bin_change, retention_change in (("nan-retention", {}, {"value": float("nan")}),
                                               ("negative-retention", {}, {"value": -0.5}),
                                               ("string-alpha", {"mean": "0.9"}, {}),
                                               ("alpha-above-one", {"mean": 1.5}, {})):
        entry = {"spec": "const:64", "budgets": [{"start": 0, "kv_budget": 64}],
                 "bins": [{**bins[0], **bin_change}], "reward": {"retention": {**retention, **retention_change}}}
        (root / f"{name}.json").write_text(json.dumps({"meta": {"model": "tiny-qwen3"},
                                                       "schedules": {"const:64": entry}}))
    (root / "loop.json").symlink_to(root / "loop.json")
    (root / "run-metrics-dir").mkdir()
    (root / "run-metrics-dir" / "metrics.jsonl").mkdir()
    (root / "draft-2.5.yaml").write_text("rollout_mode: exact\nschedule: const:48\ndraft_tokens: 2.5\n")
    (root / "draft-minus-3.yaml").write_text("rollout_mode: exact\nschedule: const:48\ndraft_tokens: -3\n")
    model, tokenizer = models.load_model("tiny-qwen3")
    model.save_pretrained(root / "hf-no-tokenizer")
    with torch.no_grad():
        model.get_input_embeddings().weight[3, 5] = float("nan")
    model.save_pretrained(root / "hf-nan")
    tokenizer.save_pretrained(root / "hf-nan")
    return root


TRAIN = ["train", "--model", "tiny-qwen3", "--data", "{files}/data.jsonl", "--reward", "first_number", "--steps", "1",
         "--prompts-per-step", "2", "--num-generations", "2", "--max-new-tokens", "4", "--schedule", "const:48",
         "--output-dir", "{tmp}/run"]
GEN = ["generate", "--model", "tiny-qwen3"]
PROFILE = ["profile", "--model", "tiny-qwen3", "--out", "{tmp}/profile", "--prompts"]
NAN = "model '{files}/hf-nan' has non-finite weights: parameter 'model.embed_tokens.weight' holds 1 NaN"

# (id, argv, text the message must hold, refused before any model is loaded)
CASES = [
    ("generate-chat-without-role", GEN + ["--prompts", "{files}/no-role.jsonl"],
     "no-role.jsonl:1: prompt message 0 is {'content': 'hi'}; expected a dict with a string 'role'", True),
    ("generate-chat-int-content", GEN + ["--prompts", "{files}/int-content.jsonl"],
     "int-content.jsonl:1: prompt message 0 has content 7; expected a string", True),
    ("profile-chat-list-content", PROFILE + ["{files}/list-content.jsonl"],
     "list-content.jsonl:1: prompt message 0 has content ['hi']; expected a string", True),
    ("bench-kv-cache-too-large", ["bench", "--model", "tiny-qwen3", "--batch", "100000000", "--context", "64"],
     "batch 100000000 x 101 cached tokens need", True),
    ("cost-gen-len-too-large", ["cost", "--schedule", "const:64", "--gen-len", "100000000000"],
     "gen_len must be an integer from 1 to 10,000,000 tokens, got 100000000000", True),
    ("train-num-logprobs-zero", TRAIN + ["--num-logprobs", "0"], "num_logprobs must be >= 1 in training", True),
    ("train-reward-wrong-count", TRAIN + ["--reward", "{files}/rewards.py:one_value"],
     "returned 1 values for 2 completions; expected 2 (checked before the first rollout", True),
    ("train-reward-nan", TRAIN + ["--reward", "{files}/rewards.py:nan"],
     "returned nan for sample 0; expected a finite float (checked before the first rollout", True),
    ("generate-rollout-workers-above-cpus", GEN + ["--prompt", "x", "--rollout-workers", "1000"],
     "rollout_workers 1000 exceeds the", True),
    ("train-rollout-workers-above-cpus", TRAIN + ["--rollout-workers", "1000"], "rollout_workers 1000 exceeds the",
     True),
    ("prompts-min-tokens-above-context", ["prompts", "--model", "tiny-qwen3", "--count", "1", "--min-tokens",
                                          "100000"],
     "min_tokens 100000 makes prompts of at least 100000 tokens", False),
    ("prompts-grown-past-context", ["prompts", "--model", "tiny-qwen3", "--count", "1", "--min-tokens", "8000"],
     "but model 'tiny-qwen3' has max_position_embeddings 8192", False),
    ("model-dir-without-tokenizer", GEN[:1] + ["--model", "{files}/hf-no-tokenizer", "--prompt", "x"],
     "hf-no-tokenizer' has no tokenizer files: expected one of tokenizer.json", False),
    ("generate-nan-weights", GEN[:1] + ["--model", "{files}/hf-nan", "--prompt", "x"], NAN, False),
    ("bench-nan-weights", ["bench", "--model", "{files}/hf-nan", "--context", "64", "--steps", "2", "--repeats", "1"],
     NAN, False),
    ("train-nan-weights", [*TRAIN[:2], "{files}/hf-nan", *TRAIN[3:]], NAN, False),
    # a device torch names but cannot use, options that would do nothing, a schedule kind
    # misspelled, a reward file that exits, a config.json without the model's sizes, --out onto the profile
    ("generate-device-mps", GEN + ["--prompt", "x", "--device", "mps"],
     "unknown device 'mps': expected cpu, cuda, cuda:N or auto", True),
    ("generate-draft-tokens-without-exact", GEN + ["--prompt", "x", "--schedule", "const:48", "--draft-tokens", "3"],
     "--draft-tokens 3 sets exact mode's drafts: it needs --rollout-mode exact", True),
    ("schedule-kind-misspelled", ["schedule", "show", "CONST:48"], "unknown schedule kind 'CONST' in 'CONST:48'", True),
    ("train-adaptive-start-without-adaptive", TRAIN + ["--adaptive-start", "const:64"],
     "adaptive_start 'const:64' does nothing without schedule adaptive", True),
    ("train-eval-every-without-eval-data", TRAIN + ["--eval-every", "3"],
     "eval_every 3 does nothing without eval_data", True),
    ("train-distill-lr-without-distill", TRAIN + ["--distill-lr", "0.5"],
     "distill_lr 0.5 does nothing without distill (the adapter)", True),
    ("train-probe-every-without-switch", TRAIN + ["--probe-every", "2"],
     "probe_every 2 does nothing without switch_schedule", True),
    ("train-kl-estimator-without-kl", TRAIN + ["--kl-estimator", "k1"],
     "kl_estimator 'k1' does nothing without kl_coef above 0", True),
    ("train-reward-file-exits", TRAIN + ["--reward", "{files}/exits.py:f"],
     "exits.py' failed: SystemExit: 3", True),
    ("cost-config-without-sizes", ["cost", "--model", "{files}/shapeless", "--schedule", "const:48"],
     "has no 'num_hidden_layers', 'hidden_size', 'num_attention_heads', 'intermediate_size', 'vocab_size'", True),
    ("train-eval-schedule-named", TRAIN + ["--eval-schedule", "const:7"], "eval_schedule: schedule 'const:7'", True),
    ("train-more-prompts-per-step-than-rows", TRAIN[:10] + ["100"] + TRAIN[11:],
     "prompts_per_step 100 exceeds the 4 training rows", True),
    ("eval-reward-nan-before-sampling", ["eval", "--model", "tiny-qwen3", "--data", "{files}/data.jsonl", "--reward",
                                         "{files}/rewards.py:nan", "--max-new-tokens", "4"],
     "returned nan for sample 0; expected a finite float (checked before the first rollout", True),
    ("cost-page-sizes-repeated", ["cost", "--schedule", "const:64", "--page-sizes", "16,16"],
     "page_sizes must be different positive integers, got '16,16'", True),
    ("cost-prompt-lens-empty-entry", ["cost", "--schedule", "const:64", "--prompt-lens", "100,,200"],
     "prompt_lens must be comma-separated integers, got '100,,200'", True),
    ("calibrate-out-onto-profile", ["calibrate", "--profile", "{files}/profile.json", "--out", "{files}/profile.json"],
     "is the profile itself", True),
    # schedule files, profile numbers, draft lengths, paths
    ("schedule-file-unknown-bin-key", ["schedule", "show", "--json", "{files}/topk.json"],
     "topk.json': bin 0 has unknown key 'topk'; expected only start and kv_budget", True),
    ("schedule-file-unknown-key", ["schedule", "show", "--json", "{files}/colour.json"],
     "colour.json': unknown key 'colour'; expected only name, page_size, version, bins", True),
    ("schedule-file-no-bins", ["schedule", "show", "--json", "{files}/no-bins.json"],
     "no-bins.json': bins is empty; expected at least one", True),
    ("generate-schedule-file-no-bins", GEN + ["--prompt", "x", "--schedule", "{files}/no-bins.json"],
     "no-bins.json': bins is empty", True),
    ("schedule-file-huge-budget", ["schedule", "show", "--json", "{files}/huge-budget.json"],
     "bin 0 budget 16000000000000000000 is out of range; expected fewer than 2**53 tokens", True),
    ("generate-schedule-file-huge-budget", GEN + ["--prompt", "x", "--schedule", "{files}/huge-budget.json"],
     "huge-budget.json': schedule 'huge-budget': bin 0 budget 16000000000000000000 is out of range", True),
    ("cost-schedule-file-huge-budget", ["cost", "--schedule", "{files}/huge-budget.json"],
     "bin 0 budget 16000000000000000000 is out of range", True),
    ("schedule-file-far-start", ["schedule", "show", "--json", "{files}/far-start.json"],
     f"bin 1 start {10**30} is out of range", True),
    ("generate-schedule-file-far-start", GEN + ["--prompt", "x", "--schedule", "{files}/far-start.json"],
     f"bin 1 start {10**30} is out of range", True),
    ("cost-schedule-file-far-start", ["cost", "--schedule", "{files}/far-start.json"],
     f"bin 1 start {10**30} is out of range", True),
    ("calibrate-retention-nan", ["calibrate", "--profile", "{files}/nan-retention.json", "--min-retention", "0.5",
                                 "--out", "{tmp}/s.json"],
     "schedule 'const:64', reward.retention.value is nan; expected a finite number >= 0 or null", True),
    ("calibrate-retention-negative", ["calibrate", "--profile", "{files}/negative-retention.json", "--min-retention",
                                      "0.5", "--out", "{tmp}/s.json"],
     "reward.retention.value is -0.5; expected a finite number >= 0 or null", True),
    ("calibrate-exact-alpha-string", ["calibrate", "--rollout-mode", "exact", "--profile", "{files}/string-alpha.json",
                                      "--out", "{tmp}/s.json"],
     "schedule 'const:64', bin 0: mean is '0.9'; expected a finite number in [0, 1] (an acceptance rate)", True),
    ("cost-acceptance-profile-alpha-string", ["cost", "--schedule", "const:64", "--acceptance-profile",
                                              "{files}/string-alpha.json"], "bin 0: mean is '0.9'; expected", True),
    ("cost-acceptance-profile-alpha-above-one", ["cost", "--schedule", "const:64", "--acceptance-profile",
                                                 "{files}/alpha-above-one.json"], "bin 0: mean is 1.5; expected", True),
    ("generate-draft-tokens-default-without-exact", GEN + ["--prompt", "x", "--draft-tokens", "4"],
     "--draft-tokens 4 sets exact mode's drafts: it needs --rollout-mode exact", True),
    ("profile-draft-tokens-without-exact", ["profile", "--model", "tiny-qwen3", "--prompts", "{files}/data.jsonl",
                                            "--out", "{tmp}/profile", "--draft-tokens", "4"],
     "--draft-tokens 4 sets exact mode's drafts: it needs --rollout-mode exact", True),
    ("generate-draft-tokens-superscript", GEN + ["--prompt", "x", "--rollout-mode", "exact", "--schedule", "const:48",
                                                 "--draft-tokens", "\u00b2"],
     "draft_tokens must be an integer in [1, 64] or 'auto' (or 0), got '\u00b2'", True),
    ("generate-draft-tokens-arabic-digit", GEN + ["--prompt", "x", "--rollout-mode", "exact", "--schedule",
                                                  "const:48", "--draft-tokens", "\u0663"],
     "draft_tokens must be an integer in [1, 64] or 'auto' (or 0), got '\u0663'", True),
    ("cost-draft-tokens-superscript", ["cost", "--schedule", "const:64", "--acceptance", "0.9", "--draft-tokens",
                                       "\u00b2"], "got '\u00b2'", True),
    ("config-draft-tokens-fraction", GEN + ["--prompt", "x", "--config", "{files}/draft-2.5.yaml"],
     "draft_tokens must be an integer in [1, 64] or 'auto' (or 0), got 2.5", True),
    ("config-draft-tokens-negative", TRAIN + ["--config", "{files}/draft-minus-3.yaml"],
     "draft_tokens must be an integer in [1, 64] or 'auto' (or 0), got -3", True),
    ("generate-dense-mode-with-schedule", GEN + ["--prompt", "x", "--rollout-mode", "dense", "--schedule",
                                                 "const:48"],
     "--rollout-mode dense decodes every rollout densely: --schedule 'const:48' would do nothing", True),
    ("train-dense-mode-with-schedule", TRAIN + ["--rollout-mode", "dense"],
     "--rollout-mode dense decodes every rollout densely: --schedule 'const:48' would do nothing", True),
    ("cost-acceptance-profile-symlink-loop", ["cost", "--schedule", "const:64", "--acceptance-profile",
                                              "{files}/loop.json"],
     "acceptance profile '{files}/loop.json' is a symlink loop", True),
    ("prompts-config-symlink-loop", ["prompts", "--config", "{files}/loop.json"],
     "config file '{files}/loop.json' is a symlink loop", True),
    ("schedule-show-symlink-loop", ["schedule", "show", "{files}/loop.json"],
     "schedule file '{files}/loop.json' is a symlink loop", True),
    ("generate-prompts-symlink-loop", GEN + ["--prompts", "{files}/loop.json"], "'{files}/loop.json' is a symlink loop",
     True),
    ("report-metrics-is-directory", ["report", "{files}/run-metrics-dir", "--out", "{tmp}/report"],
     "metrics file '{files}/run-metrics-dir/metrics.jsonl' is a directory; expected a file", True),
]


@pytest.mark.parametrize("argv, message, before_load", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_bad_value_is_one_line_and_exit_code_2(argv, message, before_load, files, tmp_path, monkeypatch, capsys,
                                               request):
    check_refused(argv, message, before_load, files, tmp_path, monkeypatch, capsys, request)


def test_an_unreadable_file_is_named_as_such(files, tmp_path, monkeypatch, capsys, request):
    """As root every file is readable, so the permission is denied by a stand-in for os.access."""
    unreadable = str(files / "data.jsonl")
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: str(path) != unreadable and access(path, mode, **kw))
    check_refused(GEN + ["--prompts", unreadable], f"prompts file {unreadable!r} cannot be read: permission denied",
                  True, files, tmp_path, monkeypatch, capsys, request)


@pytest.mark.parametrize("command", ["generate", "train"])
def test_draft_tokens_as_a_yaml_integer_is_taken(command, tmp_path):
    from sparrow.cli.config import load_config
    from sparrow.cli.generate import GenerateConfig
    from sparrow.rl.config import TrainConfig

    config = tmp_path / "cfg.yaml"
    config.write_text("rollout_mode: exact\nschedule: const:48\ndraft_tokens: 4\nmodel: tiny-qwen3\nprompt: x\n"
                      if command == "generate" else
                      "rollout_mode: exact\nschedule: const:48\ndraft_tokens: 4\nmodel: tiny-qwen3\nreward: ["
                      "first_number]\nmax_new_tokens: 4\n")
    args = argparse.Namespace(config=config, command=command)
    if command == "generate":
        assert load_config(GenerateConfig, args).sparse.draft == 4
    else:
        data = tmp_path / "data.jsonl"
        data.write_text(json.dumps({"prompt": "1 + 1 =", "answer": "2"}) + "\n")
        args.data = str(data)
        args.output_dir = str(tmp_path / "run")
        args.prompts_per_step, args.num_generations = 1, 2
        assert load_config(TrainConfig, args).sparse.draft == 4


def test_the_cost_model_refuses_lengths_past_its_maximum():
    with pytest.raises(SparrowError, match="gen_len must be an integer from 1 to 10,000,000 tokens, got 1e"):
        trajectory_cost(model_dims("tiny-qwen3"), None, parse_schedule("const:64", 16, 1), 256, 1e20, 8)
