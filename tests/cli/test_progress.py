"""Long commands say on stderr what they are doing and how far along; stdout keeps only the result."""

import json

from sparrow.cli import main


def test_bench_reports_each_phase_on_stderr_and_only_its_record_on_stdout(capsys):
    assert main(["bench", "--model", "tiny-llama", "--context", "128", "--batch", "2", "--steps", "2",
                 "--repeats", "2", "--schedule", "const:48", "--no-hf", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["sparse_over_dense"] > 0
    lines = [line for line in err.splitlines() if line.startswith("[bench ")]  # not a kernel build's note
    assert lines[0].startswith("[bench 0:0") and lines[0].endswith("tiny-llama in float32 (--dtype), weights and "
                                                                   "KV cache, in every engine")
    assert lines[1].startswith("[bench 0:0") and lines[1].endswith("prefill: 128 tokens shared by 2 rows")
    assert any("repeat 1/2: 2 decode steps x 2 rows, dense " in line for line in lines)
    assert any("repeat 2/2:" in line for line in lines)


def test_bench_warns_when_the_budget_covers_every_length_it_decodes(capsys):
    argv = ["bench", "--model", "tiny-llama", "--batch", "1", "--steps", "2", "--repeats", "1", "--no-hf", "--json"]
    assert main(argv + ["--context", "16", "--schedule", "const:48"]) == 0
    assert "warning: const:48 keeps every cached token at these lengths (16-23)" in capsys.readouterr().err
    assert main(argv + ["--context", "64", "--schedule", "const:48"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_bench_in_exact_mode_says_how_many_sequences_equal_dense(capsys):
    assert main(["bench", "--model", "tiny-qwen3", "--context", "160", "--batch", "2", "--steps", "4",
                 "--repeats", "1", "--schedule", "const:48", "--rollout-mode", "exact", "--draft-tokens", "2"]) == 0
    out, err = capsys.readouterr()
    assert out.count("\n") == 1 and "identical to dense: 2 of 2 sequences" in out
    assert "repeat 1/1: 4 tokens x 2 rows" in err and "2 of 2 exact sequences identical to dense" in err


def test_profile_announces_each_schedule_on_stderr_and_ends_saying_where_it_wrote(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "abc " * (20 + i)}) + "\n" for i in range(2)))
    out = tmp_path / "prof"
    assert main(["profile", "--model", "tiny-llama", "--prompts", str(prompts), "--schedules", "const:48,dense",
                 "--samples-per-prompt", "1", "--max-new-tokens", "8", "--out", str(out)]) == 0
    printed, err = capsys.readouterr()
    assert "[1/2] const:48: sampling 2 completions" in err and "[2/2] dense" in err
    assert "measuring acceptance: teacher-forcing" in err and f"writing {out}" in err
    assert "[profile" not in printed and printed.splitlines()[-1].startswith(f"wrote {out}/profile.json")
