"""The `sparrow` command line on tiny models: output formats and clear errors."""

import json
import subprocess
import sys

import pytest
import torch

from sparrow.cli import main


def test_generate_json_has_one_line_per_completion_with_the_records(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello there"}\n{"prompt": [{"role": "user", "content": "hi"}]}\n')
    code = main(["generate", "--model", "tiny-qwen3", "--prompts", str(prompts), "--schedule", "const:48",
                 "--max-new-tokens", "6", "--num-samples", "2", "--seed", "3", "--json"])
    assert code == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in rows:
        assert {"text", "token_ids", "logprobs", "kv_budget", "top_logprobs", "finish_reason"} <= set(r)
        assert len(r["token_ids"]) == len(r["logprobs"]) == len(r["kv_budget"]) <= 6


def test_generate_reads_options_from_yaml_and_the_command_line_wins(tmp_path, capsys):
    config = tmp_path / "g.yaml"
    config.write_text("model: tiny-llama\nprompt: abc\nmax_new_tokens: 3\ntemperature: 0\n")
    assert main(["generate", "--config", str(config), "--max-new-tokens", "2", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert len(row["token_ids"]) <= 2


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "nope", "--prompt", "x"], "nope"),
    (["generate", "--model", "tiny-llama"], "exactly one of --prompt"),
    (["generate", "--model", "tiny-llama", "--prompt", "x", "--schedule", "const:50"], "multiple of the page size"),
    (["generate", "--model", "tiny-llama", "--prompts", "missing.jsonl"], "does not exist"),
    (["generate", "--model", "tiny-llama", "--prompt", "x", "--landmark", "mean"], "unknown landmark"),
    (["generate", "--model", "tiny-llama", "--prompt", "x", "--dense-layers", "0,9"], "out of range"),
    (["bench", "--model", "tiny-llama", "--schedule", "dense"], "other than 'dense'"),
    (["bench", "--model", "tiny-llama", "--block-size", "128"], "--block-size 128: needs --backend vllm"),
    (["bench", "--model", "tiny-llama", "--backend", "vllm", "--block-size", "40"], "a multiple of 16"),
    (["bench", "--model", "tiny-llama", "--backend", "vllm", "--block-size", "1048576", "--context", "512"],
     "--block-size 1048576 is longer than the benchmark's sequences"),
    (["bench", "--model", "tiny-llama", "--rollout-mode", "exact", "--draft-tokens", "auto", "--backend", "vllm"],
     "fixes the draft length when the engine starts"),
    (["generate", "--model", "tiny-llama", "--prompt", "x", "--rollout-mode", "exact"], "drafts with a sparse"),
    (["generate", "--model", "tiny-llama", "--prompt", "x", "--rollout-mode", "fast"], "unknown rollout mode 'fast'"),
    (["generate", "--model", "tiny-llama", "--prompt", "x", "--schedule", "const:48", "--rollout-mode", "exact",
      "--draft-tokens", "auto", "--backend", "vllm"], "fixes the draft length when the engine starts"),
    (["eval", "--model", "tiny-llama", "--data", "examples/tiny-data.jsonl", "--schedule", "const:48",
      "--draft-tokens", "65"], "draft_tokens must be an integer in [1, 64] or 'auto' (or 0), got 65"),
    (["eval", "--model", "tiny-llama", "--data", "examples/tiny-data.jsonl", "--schedule", "const:48",
      "--rollout-mode", "exact", "--draft-tokens", "lots"], "or 'auto' (or 0), got 'lots'"),
    (["generate", "--model", "tiny-llama", "--prompt", "x", "--schedule", "const:48", "--exact-rule", "residual"],
     "--exact-rule residual judges exact mode's drafts: it needs --rollout-mode exact"),
    (["generate", "--model", "tiny-llama", "--prompt", "x", "--schedule", "const:48", "--rollout-mode", "exact",
      "--exact-rule", "optimal"], "unknown exact rule 'optimal': expected one of coupled, residual"),
    (["bench", "--model", "tiny-llama", "--exact-rule", "residual"],
     "--exact-rule residual judges exact mode's drafts: it needs --rollout-mode exact"),
    (["bench", "--model", "tiny-llama", "--rollout-mode", "exact", "--exact-rule", "best"],
     "--exact-rule 'best': expected one of coupled, residual"),
    (["bench", "--model", "tiny-llama", "--device", "cpu", "--predict"],
     "--predict prices the machine bench runs on (a CPU), not --hardware 'h200': give --hardware cpu"),
    (["bench", "--model", "tiny-llama", "--predict", "--hardware", "cpu", "--peak-flops", "1e11"],
     "hardware 'cpu' has no published numbers: give --bandwidth"),
    (["cost", "--schedule", "const:1024", "--kv-bytes", "0"], "kv_bytes must be a finite number > 0 and <= 64, got 0"),
])
def test_bad_input_gives_one_clear_error(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_bad_prompt_rows_are_reported_with_their_line(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "ok"}\n{"text": "no prompt field"}\n')
    assert main(["generate", "--model", "tiny-llama", "--prompts", str(prompts)]) == 2
    assert "p.jsonl:2" in capsys.readouterr().err


def test_bench_reports_all_rates_as_json(capsys):
    code = main(["bench", "--model", "tiny-llama", "--context", "256", "--batch", "2", "--steps", "3",
                 "--repeats", "1", "--warmup", "1", "--schedule", "const:64", "--json"])
    assert code == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    for key in ("dense_tokens_per_s", "sparse_tokens_per_s", "hf_tokens_per_s", "sparse_over_dense"):
        assert result[key] > 0
    assert result["kv_bytes_per_step"]["sparse_kv"] < result["kv_bytes_per_step"]["dense_kv"]
    # what ran: the dtype in the log and the record, and which of torch's CPU kernels (AVX2 and AVX-512 differ)
    assert "tiny-llama in float32 (--dtype), weights and KV cache, in every engine" in captured.err
    assert result["config"]["model"]["dtype"] == "float32"
    assert result["machine"]["torch_cpu_kernels"] == torch.backends.cpu.get_cpu_capability()


def test_bench_in_exact_mode_reports_its_ratio_and_identical_tokens(capsys):
    code = main(["bench", "--model", "tiny-llama", "--context", "200", "--batch", "2", "--steps", "12",
                 "--repeats", "2", "--schedule", "const:48", "--rollout-mode", "exact", "--draft-tokens", "3",
                 "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["exact_over_dense"] == result["exact_tokens_per_s"] / result["dense_tokens_per_s"] > 0
    assert result["identical_sequences"] == result["sequences"] == 4  # the dense policy's own tokens
    assert 1 <= result["tokens_per_verify"] <= 4 and 0 < result["coupled_acceptance"] <= 1
    assert result["prompt_tokens"] == 200


@pytest.mark.parametrize("mode", ["sparse", "exact"])
def test_bench_predicts_each_step_it_measures_with_the_cost_model(mode, capsys):
    from sparrow.measure.cost_model import Pricing, compare, hardware
    from sparrow.measure.exact_cost import exact_decode
    from sparrow.model_shapes import model_dims
    from sparrow.schedules import parse_schedule

    machine = ["--hardware", "cpu", "--peak-flops", "1e11", "--bandwidth", "2e10", "--step-overhead", "0.001"]
    exact = ["--rollout-mode", "exact", "--draft-tokens", "3"] if mode == "exact" else []
    code = main(["bench", "--model", "tiny-llama", "--context", "200", "--batch", "2", "--steps", "6", "--repeats", "1",
                 "--warmup", "1", "--schedule", "const:48", "--no-hf", "--predict", "--json", *machine, *exact])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    predicted = result["predicted"]
    assert set(predicted) == ({"dense", "sparse", "exact"} if exact else {"dense", "sparse"})
    hw, dims = hardware("cpu", 1e11, 2e10, 0.001), model_dims("tiny-llama")
    trajectory = (dims, hw, parse_schedule("const:48"), 200, 6, 2)
    float32 = Pricing(bytes_per_param=4, bytes_per_kv=4)
    model = compare(*trajectory, pricing=float32)
    want = {"dense": model["dense_step_s"], "sparse": model["sparse_step_s"]}
    if exact:
        ratio = exact_decode(*trajectory, result["coupled_acceptance"], 3, pricing=float32)["exact_over_dense"]
        want["exact"] = want["dense"] / ratio
    for name, step in predicted.items():
        assert step["predicted_ms"] == pytest.approx(1e3 * want[name])
        assert step["measured_ms"] == pytest.approx(1e3 * 2 / result[f"{name}_tokens_per_s"])  # 2 rows a step
        assert step["residual_ms"] == pytest.approx(step["measured_ms"] - step["predicted_ms"])
    assert want["dense"] > want["sparse"] > 0.001  # the step overhead is in both


def test_bench_prints_the_predicted_steps_beside_the_measured_ones(capsys):
    code = main(["bench", "--model", "tiny-llama", "--context", "200", "--batch", "2", "--steps", "3", "--repeats", "1",
                 "--warmup", "1", "--schedule", "const:48", "--no-hf", "--predict", "--hardware", "cpu",
                 "--peak-flops", "1e11", "--bandwidth", "2e10"])
    assert code == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("cost model (cpu), ms per step predicted / measured (measured - predicted): dense ")
    assert "; sparse " in line


def test_bench_times_the_residual_rule_when_asked(capsys, monkeypatch):
    from sparrow.engine import exact

    judged = []
    rule = exact._judge_residual
    monkeypatch.setattr(exact, "_judge_residual", lambda *a, **k: judged.append(1) or rule(*a, **k))
    argv = ["bench", "--model", "tiny-llama", "--context", "200", "--batch", "2", "--steps", "12", "--repeats", "2",
            "--schedule", "const:48", "--rollout-mode", "exact", "--draft-tokens", "3", "--json"]
    assert main(argv) == 0 and not judged  # the coupling by default
    capsys.readouterr()
    assert main(argv + ["--exact-rule", "residual"]) == 0 and judged
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["config"]["exact_rule"] == "residual" and result["exact_tokens_per_s"] > 0
    assert 0 < result["coupled_acceptance"] <= 1 and 1 <= result["tokens_per_verify"] <= 4
    assert "residual acceptance" in captured.err


def test_generate_in_exact_mode_equals_dense_generation(capsys):
    base = ["generate", "--model", "tiny-qwen2", "--prompt", "a prompt of some length", "--max-new-tokens", "20",
            "--num-samples", "3", "--seed", "4", "--json"]
    assert main(base + ["--schedule", "dense"]) == 0
    dense = [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()]
    assert main(base + ["--schedule", "const:48", "--rollout-mode", "exact", "--draft-tokens", "6"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["token_ids"] for r in rows] == dense
    assert all(r["verifies"] >= 1 and len(r["drafted"]) == len(r["token_ids"]) for r in rows)
    assert main(base + ["--schedule", "const:48", "--rollout-mode", "exact", "--draft-tokens", "auto"]) == 0
    assert [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()] == dense
    assert main(base + ["--schedule", "const:48", "--rollout-mode", "exact", "--exact-rule", "residual"]) == 0
    residual = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(residual) == 3 and all(r["verifies"] >= 1 and 1 <= len(r["token_ids"]) <= 20 for r in residual)


@pytest.mark.parametrize("module", ["sparrow.cli.report", "sparrow.cli.schedule"])
def test_the_report_and_schedule_commands_import_no_torch(module):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "False"


def test_a_long_generate_json_run_prints_each_call_as_it_finishes_and_reports_it(tmp_path, capsys, monkeypatch):
    """--json into a file or pipe (no progress bar): calls of whole waves, completions printed as each finishes, one
    stderr line per call; the output is the single call's, byte for byte. A run of one call stays silent."""
    from sparrow.cli import generate

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ["a", "bb", "a", "hello there", "c"]))
    argv = ["generate", "--model", "tiny-qwen3", "--prompts", str(prompts), "--max-new-tokens", "3", "--num-samples",
            "2", "--max-batch-size", "4", "--schedule", "const:48", "--json"]
    monkeypatch.setattr(generate, "CALL_WAVES", 1)  # a wave holds 2 prompts: 3 calls
    assert main(argv) == 0
    chunked = capsys.readouterr()
    monkeypatch.setattr(generate, "CALL_WAVES", 16)
    assert main(argv) == 0
    single = capsys.readouterr()
    assert chunked.out == single.out and single.err == ""
    assert [json.loads(line)["prompt_index"] for line in chunked.out.splitlines()] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    lines = chunked.err.splitlines()
    assert len(lines) == 5 and lines[1].endswith("generating 5 prompt(s) x 2 sample(s) in 3 calls")
    assert [line.split("] ")[1] for line in lines[2:]] == ["2/5 prompts done", "4/5 prompts done", "5/5 prompts done"]
