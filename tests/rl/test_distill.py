"""DistillSparse on tiny models: the dense policy is untouched by the adapter, the adapter step moves only the
adapter and raises the sparse actor's acceptance, checkpoints keep both, switching and config checks."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from sparrow.attention import SparseConfig
from sparrow.attention.interface import base_model
from sparrow.datasets import DataSpec, Example, load_examples
from sparrow.engine import SamplingParams
from sparrow.errors import SparrowError
from sparrow.lora import attach_adapter, base_parameters
from sparrow.measure import teacher_forced_acceptance
from sparrow.measure.batch import RolloutBatch
from sparrow.models import load_model
from sparrow.rl.config import TrainConfig
from sparrow.rl.distill import DistillConfig, Distiller
from sparrow.rl.losses import full_kl
from sparrow.rl.probes import probe
from sparrow.rl.step import Policy, StepConfig
from sparrow.rl.trainer import train
from sparrow.rollout import NativeBackend
from sparrow.schedules import DENSE, const
from sparrow.schedules.controllers import SwitchState, observe_probe
from sparrow.typed_config import build, flatten_mapping
from tests.fake_backend import ReplayBackend
from tests.reference import token_logprobs
from tests.steps import grpo_step


def byte_mean(prompts, completions, **_):
    return [sum(c.encode()) / (255 * max(1, len(c.encode()))) for c in completions]


EXAMPLES = [Example(0, "the cat sat on the mat " * 12, "1", {}), Example(1, "a b c d e f g " * 20, "2", {})]
CFG = build(StepConfig, {"num_generations": 4, "max_new_tokens": 12, "micro_batch_size": 3, "mini_batches": 2})


def _adapted(cfg: DistillConfig | None = None, b_std: float = 0.1):
    """tiny-qwen3 with a LoRA adapter whose B is nonzero, so the adapter changes the model's outputs."""
    cfg = cfg or DistillConfig(lr=1e-3)
    model, tok = load_model("tiny-qwen3")
    model = attach_adapter(model, cfg.lora())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=b_std)
    return model, tok, Distiller(model, cfg)


def _base_state(model) -> dict[str, torch.Tensor]:
    """The base weights under their plain transformers names."""
    return {k.replace(".base_layer", ""): v.detach().clone() for k, v in base_model(model).state_dict().items()
            if "lora_" not in k}


def _rollouts(backend, prompts, schedule, tokens=12, samples=4, seed=0):
    return backend.generate(prompts, SamplingParams(max_new_tokens=tokens, seed=seed), schedule, samples)


def test_the_dense_policy_and_its_update_are_the_same_with_and_without_an_adapter():
    plain, tok = load_model("tiny-qwen3")
    completions = _rollouts(NativeBackend(plain, tok), [ex.prompt for ex in EXAMPLES], const(64))
    rewards = [("bytes", byte_mean, 1.0)]
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    plain_metrics = grpo_step(Policy(plain, plain_opt), ReplayBackend(completions), EXAMPLES, rewards, const(64),
                              CFG, seed=0)

    model, _, distiller = _adapted()
    ids = torch.tensor([completions[0].prompt_token_ids + completions[0].token_ids])
    with torch.no_grad(), distiller.dense():
        assert torch.equal(model(input_ids=ids).logits, load_model("tiny-qwen3")[0](input_ids=ids).logits)
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-3)
    optimizer = torch.optim.AdamW(base_parameters(model), lr=1e-3)
    assert len(base_parameters(model)) == len(list(plain.parameters()))
    metrics = grpo_step(Policy(model, optimizer, distiller=distiller), ReplayBackend(completions), EXAMPLES, rewards,
                        const(64), CFG, seed=0)

    for key in ("loss", "grad_norm", "clip_ratio", "sampling/sampling_logp_difference/mean",
                "sampling/importance_sampling_ratio/max", "mismatch/acceptance_lower/mean",
                "mismatch/acceptance_upper/mean"):
        assert metrics[key] == plain_metrics[key], key
    updated, reference = _base_state(model), plain.state_dict()
    assert set(updated) == set(reference)
    assert all(torch.equal(updated[k], reference[k]) for k in reference)
    assert {"distill/loss", "distill/ppo_loss", "distill/kl", "distill/grad_norm", "distill/logp_difference_mean",
            "time/distill_s"} <= set(metrics)


@pytest.mark.parametrize("kl", ["k3", "forward", "reverse"])
def test_the_adapter_step_moves_only_the_adapter(kl):
    model, tok, distiller = _adapted(DistillConfig(lr=1e-3, kl=kl, kl_lambda=0.5))
    backend = NativeBackend(model, tok)
    batch = RolloutBatch.from_completions(_rollouts(backend, [ex.prompt for ex in EXAMPLES], const(48), samples=2))
    with torch.no_grad(), distiller.dense():
        logp_old = token_logprobs(model(input_ids=batch.input_ids).logits, batch.input_ids)
    base = _base_state(model)
    adapter = [p.detach().clone() for p in distiller.params]
    metrics = distiller.step(batch, logp_old, torch.tensor([1.0, -1.0, 0.5, -0.5]), const(48), CFG)
    assert all(torch.equal(v, _base_state(model)[k]) for k, v in base.items())
    assert any(not torch.equal(a, p) for a, p in zip(adapter, distiller.params))
    assert all(p.grad is None for p in distiller.params)
    assert all(p.requires_grad for p in model.parameters())
    assert metrics["distill/kl"] > 0 and metrics["distill/grad_norm"] > 0
    assert metrics["distill/logp_difference_mean"] > 0 and not model.training


def test_distillation_raises_the_acceptance_of_the_sparse_actor_against_the_dense_policy():
    """Exact acceptance (teacher-forced, the dense policy without the adapter) on held-out prompts, under a
    budget of only the three always-kept pages; on this tiny model p5 goes 0.894 -> 0.941."""
    cfg = DistillConfig(lr=3e-3, kl_lambda=1.0)
    model, tok = load_model("tiny-qwen3")
    model = attach_adapter(model, cfg.lora())
    distiller = Distiller(model, cfg)
    backend = NativeBackend(model, tok)
    prompts = [ex.prompt for ex in load_examples(DataSpec("examples/tiny-data.jsonl"))]
    schedule, held_out = const(48), SamplingParams(max_new_tokens=16, seed=7)
    _, before = probe(backend, model, prompts[6:], schedule, held_out, 4, SparseConfig(), 64)
    batch = RolloutBatch.from_completions(_rollouts(backend, prompts[:6], schedule, tokens=16, samples=2))
    with torch.no_grad(), distiller.dense():
        logp_old = token_logprobs(model(input_ids=batch.input_ids).logits, batch.input_ids)
    for _ in range(8):
        distiller.step(batch, logp_old, torch.zeros(12), schedule, build(StepConfig, {"micro_batch_size": 4}))
    _, after = probe(backend, model, prompts[6:], schedule, held_out, 4, SparseConfig(), 64)
    assert after["probe/acceptance/p5"] > before["probe/acceptance/p5"] + 0.02
    assert after["probe/acceptance/mean"] > before["probe/acceptance/mean"] + 0.01


def test_the_measured_dense_policy_runs_without_the_adapter():
    model, tok, _ = _adapted()
    prompts, sampling = [ex.prompt for ex in EXAMPLES], SamplingParams(max_new_tokens=6, seed=0)
    completions = NativeBackend(model, tok).generate(prompts, sampling, DENSE)
    alphas = teacher_forced_acceptance(model, completions, DENSE, SparseConfig(), 1.0)
    assert min(a for row in alphas for a in row) < 0.99  # the adapter actor vs the dense policy
    plain = load_model("tiny-qwen3")[0]
    alphas = teacher_forced_acceptance(plain, completions, DENSE, SparseConfig(), 1.0)
    assert min(a for row in alphas for a in row) > 0.9999  # without an adapter the actor is the dense policy


def _config(data, out, **overrides):
    values = {"model": "tiny-qwen3", "data": str(data), "reward": ["tests.rl.test_distill:byte_mean"], "steps": 2,
              "prompts_per_step": 2, "num_generations": 2, "max_new_tokens": 8, "learning_rate": 1e-3,
              "schedule": "const:64", "micro_batch_size": 4, "output_dir": str(out), "distill": True,
              "distill_lr": 1e-3, "switch_schedule": "const:48", "probe_every": 1, "probe_prompts": 1,
              "probe_patience": 1, "tau": 0.0, "bin_size": 64}
    return build(TrainConfig, {**values, **overrides})


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": "abc " * (10 + i), "answer": str(i)}) + "\n" for i in range(5)))
    return path


def test_checkpoints_keep_a_plain_policy_and_the_adapter_and_resume_restores_both(data, tmp_path):
    full = tmp_path / "full"
    history = train(_config(data, full), log=lambda *_: None)
    assert [h["distill/switched"] for h in history] == [1.0, 1.0]  # tau 0: the first probe switches
    assert "probe/acceptance/p5" in history[0] and "probe/acceptance/p5" not in history[1]
    ckpt = full / "checkpoint-2"
    assert not any("lora_" in k or "base_layer" in k for k in load_file(ckpt / "model.safetensors"))
    policy, info = AutoModelForCausalLM.from_pretrained(ckpt, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert {"adapter_config.json", "adapter_model.safetensors", "optimizer.pt"} <= {
        p.name for p in (ckpt / "adapter").iterdir()}
    from peft import PeftModel

    assert isinstance(PeftModel.from_pretrained(policy, ckpt / "adapter"), PeftModel)
    assert json.loads((ckpt / "trainer_state.json").read_text())["switch"] == {"streak": 1, "switched_at": 1}

    split = tmp_path / "split"
    train(_config(data, split, steps=1), log=lambda *_: None)
    train(_config(data, split, resume=True), log=lambda *_: None)
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        a, b = load_file(ckpt / name), load_file(split / "checkpoint-2" / name)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), name
    a = torch.load(ckpt / "adapter" / "optimizer.pt", weights_only=True)["state"]
    b = torch.load(split / "checkpoint-2" / "adapter" / "optimizer.pt", weights_only=True)["state"]
    assert all(torch.equal(a[i]["exp_avg"], b[i]["exp_avg"]) for i in a)
    with pytest.raises(SparrowError, match="distill.enabled: True -> False"):
        train(_config(data, split, steps=3, resume=True, distill=False), log=lambda *_: None)


def test_the_tiny_distill_example_runs(tmp_path):
    from sparrow.cli import main

    out = tmp_path / "tiny-distill"
    assert main(["train", "--config", "examples/tiny-distill.yaml", "--output-dir", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all({"distill/loss", "distill/kl", "distill/switched"} <= set(r) for r in rows)
    assert "probe/acceptance/p5" in rows[0]
    assert (out / f"checkpoint-{len(rows)}" / "adapter" / "adapter_config.json").exists()


def test_the_distill_example_configs_name_only_known_options():
    import yaml

    for path in ("examples/tiny-distill.yaml", "examples/smollm2-distill.yaml"):
        values = flatten_mapping(TrainConfig, yaml.safe_load(Path(path).read_text()), path)
        assert values["distill"] is True, path


def test_the_switch_needs_patience_consecutive_passing_probes_and_then_stays():
    state = SwitchState()
    trace = []
    for step, bins in enumerate([[0.9, 0.8], [0.9, 0.87], [0.85, 0.9], [0.86, 0.9], [0.87], [0.1]], start=1):
        state = observe_probe(state, bins, tau=0.86, patience=2, step=step)
        trace.append((state.streak, state.switched_at))
    assert trace == [(0, None), (1, None), (0, None), (1, None), (2, 5), (2, 5)]
    assert observe_probe(SwitchState(), [], tau=0.0, patience=1, step=1) == SwitchState()  # no bins: no evidence
    assert observe_probe(SwitchState(), [0.5], tau=0.5, patience=1, step=3).switched_at == 3
    assert SwitchState.from_json(SwitchState(2, 7).to_json()) == SwitchState(2, 7)


def test_full_kl_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.5]]))
    ref = torch.log(torch.tensor([[0.25, 0.75]]))
    forward = 0.25 * torch.log(torch.tensor(0.5)) + 0.75 * torch.log(torch.tensor(1.5))
    reverse = 0.5 * torch.log(torch.tensor(2.0)) + 0.5 * torch.log(torch.tensor(2 / 3))
    assert torch.allclose(full_kl(logits, ref, "forward"), forward[None])
    assert torch.allclose(full_kl(logits, ref, "reverse"), reverse[None])
    assert torch.allclose(full_kl(ref, ref, "reverse"), torch.zeros(1), atol=1e-7)
    with pytest.raises(SparrowError, match="'sideways'"):
        full_kl(logits, ref, "sideways")


@pytest.mark.parametrize("values, message", [
    ({"rank": 0}, "distill_rank must be an integer >= 1, got 0"),
    ({"lr": 0.0}, "distill_lr must be a number > 0, got 0.0"),
    ({"lr": "1e-4"}, "distill_lr must be a number > 0, got '1e-4'"),
    ({"alpha": -1}, "distill_alpha must be a number > 0"),
    ({"kl_lambda": -0.1}, "distill_lambda must be a number >= 0"),
    ({"dropout": 1.0}, r"distill_dropout must be a number in \[0, 1\)"),
    ({"kl": "k2"}, "unknown distill_kl 'k2': expected one of k3, forward, reverse"),
    ({"targets": " , "}, "distill_targets must be 'all-linear' or comma-separated module names"),
])
def test_bad_distill_configs_say_what_is_wrong(values, message):
    with pytest.raises(SparrowError, match=message):
        DistillConfig(**values)


@pytest.mark.parametrize("overrides, message", [
    ({"distill_kl": "exact"}, "unknown distill_kl 'exact'"),
    ({"switch_schedule": "const:64"}, "is the rollout schedule itself"),
    ({"switch_schedule": "const:50"}, "multiple of the page size"),
    ({"switch_schedule": None, "probe_data": "x.jsonl"}, "give switch_schedule as well"),
    ({"probe_patience": 0}, "probe_patience must be an integer >= 1"),
])
def test_bad_distill_train_options_stop_before_any_work(data, tmp_path, overrides, message):
    with pytest.raises(SparrowError, match=message):
        _config(data, tmp_path / "x", **overrides).validate()


def test_targets_that_match_nothing_are_refused():
    model, _ = load_model("tiny-qwen3")
    with pytest.raises(SparrowError, match="distill_targets 'nope_proj'"):
        attach_adapter(model, DistillConfig(targets="nope_proj").lora())


def test_generate_takes_an_adapter_and_refuses_a_directory_that_is_not_one(tmp_path, capsys):
    from sparrow.cli import main

    model, _, _ = _adapted(b_std=0.5)
    model.save_pretrained(tmp_path / "adapter")
    argv = ["generate", "--model", "tiny-qwen3", "--prompt", "hello there", "--max-new-tokens", "8",
            "--temperature", "0", "--schedule", "const:48", "--json"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*argv, "--adapter", str(tmp_path / "adapter")]) == 0
    adapted = json.loads(capsys.readouterr().out)
    assert adapted["token_ids"] != plain["token_ids"]
    assert main([*argv, "--adapter", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is not a peft adapter directory" in err and "Traceback" not in err


def test_gradient_checkpointing_gives_the_same_policy_and_adapter_steps():
    """Both updates (the policy's and the adapter's, full KL) with checkpointed layers: same losses, gradient norms
    and weights as without, so the option only trades memory for a second forward."""
    plain, tok = load_model("tiny-qwen3")
    completions = _rollouts(NativeBackend(plain, tok), [ex.prompt for ex in EXAMPLES], const(48))
    rewards = [("bytes", byte_mean, 1.0)]
    metrics, weights = [], []
    for checkpointing in (False, True):
        model, _, distiller = _adapted(DistillConfig(lr=1e-3, kl="forward"))
        cfg = build(StepConfig, {"num_generations": 4, "max_new_tokens": 12, "micro_batch_size": 3,
                                 "mini_batches": 2, "gradient_checkpointing": checkpointing})
        optimizer = torch.optim.AdamW(base_parameters(model), lr=1e-3)
        metrics.append(grpo_step(Policy(model, optimizer, distiller=distiller), ReplayBackend(completions),
                                 EXAMPLES, rewards, const(48), cfg, seed=0))
        weights.append([p.detach().clone() for p in model.parameters()])
    for key in ("loss", "grad_norm", "distill/loss", "distill/kl", "distill/grad_norm"):
        assert metrics[1][key] == pytest.approx(metrics[0][key], rel=1e-5, abs=1e-7), key
    assert metrics[0]["distill/grad_norm"] > 0
    assert all(torch.allclose(a, b, atol=3e-5) for a, b in zip(*weights))
