"""Prompt datasets: JSONL / verl-style Parquet loading and its errors, the deterministic sampler."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparrow.datasets import (
    DataSpec,
    Example,
    PromptSampler,
    load_examples,
)
from sparrow.errors import SparrowError


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def write_verl_parquet(path, rows=None):
    rows = rows or [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
            "ability": "math",
            "reward_model": {"ground_truth": str(2 * i), "style": "rule"},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(3)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


# --- loading ------------------------------------------------------------------------------------------------------


def test_jsonl_text_and_chat_prompts(tmp_path):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"prompt": "1+1?", "answer": "2", "source": "a"})
        + "\n\n"
        + json.dumps({"prompt": chat, "answer": 4, "source": "b", "level": 3})
        + "\n"
    )
    examples = load_examples(DataSpec(str(path)))
    assert examples == [
        Example(0, "1+1?", "2", {"source": "a"}),
        Example(1, chat, 4, {"source": "b", "level": 3}),
    ]


def test_json_extension_and_custom_field_names(tmp_path):
    path = write_jsonl(tmp_path / "d.json", [{"question": "q1", "solution": "s1", "answer": "not this"}])
    (example,) = load_examples(DataSpec(path, prompt_field="question", answer_field="solution"))
    assert (example.prompt, example.answer, example.columns) == ("q1", "s1", {"answer": "not this"})


def test_dotted_answer_path_and_missing_answers_everywhere(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "meta": {"gold": [1, 2]}}])
    (example,) = load_examples(DataSpec(path, answer_field="meta.gold"))
    assert example.answer == [1, 2] and example.columns == {"meta": {"gold": [1, 2]}}
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "p"}, {"prompt": "q", "id": 7}])
    assert [e.answer for e in load_examples(DataSpec(path))] == [None, None]


def test_verl_parquet_loads_with_defaults(tmp_path):
    examples = load_examples(DataSpec(write_verl_parquet(tmp_path / "train.parquet")))
    assert [e.index for e in examples] == [0, 1, 2]
    assert [e.answer for e in examples] == ["0", "2", "4"]
    assert examples[1].prompt == [{"role": "user", "content": "What is 1 + 1?"}]
    assert examples[2].columns == {
        "data_source": "openai/gsm8k",
        "ability": "math",
        "reward_model": {"ground_truth": "4", "style": "rule"},
        "extra_info": {"split": "train", "index": 2},
    }


def test_bad_jsonl_rows_reported_together_with_line_numbers(tmp_path):
    path = tmp_path / "bad.jsonl"
    rows = [
        {"prompt": "ok", "answer": 1},
        {"question": "no prompt", "answer": 2},
        {"prompt": "", "answer": 3},
        {"prompt": [{"role": "user", "content": 5}], "answer": 4},
        {"prompt": "no answer"},
        {"prompt": [], "answer": 6},
        {"prompt": ["text"], "answer": 7},
        {"prompt": 42, "answer": 8},
    ]
    write_jsonl(path, rows)
    with pytest.raises(SparrowError) as err:
        load_examples(DataSpec(str(path)))
    message = str(err.value)
    assert "bad.jsonl" in message and "7 bad line(s)" in message
    for line in range(2, 9):
        assert f"line {line}:" in message
    assert "line 1:" not in message
    assert "missing prompt field 'prompt'" in message
    assert "missing answer field 'answer'" in message
    assert "content 5" in message


def test_more_than_ten_bad_rows_are_summarised(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ok"}] + [{"prompt": ""}] * 12)
    with pytest.raises(SparrowError, match=r"12 bad line\(s\)") as err:
        load_examples(DataSpec(path))
    assert "line 11:" in str(err.value) and "line 12:" not in str(err.value)
    assert "and 2 more" in str(err.value)


def test_bad_parquet_rows_reported_with_row_numbers(tmp_path):
    rows = [
        {"prompt": [{"role": "user", "content": "fine"}], "reward_model": {"ground_truth": "1"}},
        {"prompt": [], "reward_model": {"ground_truth": "2"}},
        {"prompt": [{"role": "user", "content": "fine"}], "reward_model": None},
    ]
    path = write_verl_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(SparrowError) as err:
        load_examples(DataSpec(path))
    message = str(err.value)
    assert "bad.parquet" in message and "rows counted from 0" in message
    assert "row 1: prompt is an empty list" in message
    assert "row 2: missing answer field 'reward_model.ground_truth'" in message
    assert "row 0:" not in message


def test_wrong_prompt_field_names_the_available_fields(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": 1}])
    with pytest.raises(SparrowError, match=r"no row has the prompt field 'prompt'.*\['answer', 'question'\]"):
        load_examples(DataSpec(path))


def test_file_errors(tmp_path):
    with pytest.raises(SparrowError, match="does not exist"):
        load_examples(DataSpec(str(tmp_path / "missing.jsonl")))
    (tmp_path / "d.csv").write_text("prompt,answer\n")
    with pytest.raises(SparrowError, match=r"extension '\.csv'.*\.jsonl"):
        load_examples(DataSpec(str(tmp_path / "d.csv")))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(SparrowError, match="is empty"):
        load_examples(DataSpec(str(tmp_path / "empty.jsonl")))
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(SparrowError, match="holds no rows"):
        load_examples(DataSpec(str(tmp_path / "blank.jsonl")))
    (tmp_path / "junk.parquet").write_bytes(b"not a parquet file at all")
    with pytest.raises(SparrowError, match="not a readable Parquet file"):
        load_examples(DataSpec(str(tmp_path / "junk.parquet")))
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "none.parquet")
    with pytest.raises(SparrowError, match="holds no rows"):
        load_examples(DataSpec(str(tmp_path / "none.parquet")))
    with pytest.raises(SparrowError, match="both 'x'"):
        load_examples(DataSpec(str(tmp_path / "blank.jsonl"), prompt_field="x", answer_field="x"))


# --- sampling -----------------------------------------------------------------------------------------------------


def test_every_example_once_per_epoch():
    sampler = PromptSampler(12, 4, seed=3)
    walk = [i for step in range(9) for i in sampler.batch(step)]
    for epoch in range(3):
        assert sorted(walk[12 * epoch : 12 * (epoch + 1)]) == list(range(12))
    assert walk[:12] != walk[12:24]


def test_batches_are_a_pure_function_of_seed_and_step():
    sequential = PromptSampler(10, 3, seed=7)
    walk = [sequential.batch(step) for step in range(15)]
    for step in (0, 3, 4, 9, 14):
        assert PromptSampler(10, 3, seed=7).batch(step) == walk[step]
    assert [PromptSampler(10, 3, seed=8).batch(step) for step in range(3)] != walk[:3]
    orders = [np.random.default_rng([7, epoch]).permutation(10).tolist() for epoch in range(2)]
    assert walk[:4] == [orders[0][0:3], orders[0][3:6], orders[0][6:9], orders[0][9:] + orders[1][:2]]


def test_sampler_has_no_unused_shuffle_option():
    with pytest.raises(TypeError, match="shuffle"):
        PromptSampler(10, 3, seed=7, shuffle=False)


def test_batch_straddles_epoch_boundary():
    sampler = PromptSampler(5, 3, seed=1)
    first, second = PromptSampler(5, 5, seed=1).batch(0), PromptSampler(5, 5, seed=1).batch(1)
    assert sampler.batch(1) == first[3:] + second[:1]


def test_batch_larger_than_dataset_wraps_epochs():
    batch = PromptSampler(3, 8, seed=0).batch(0)
    assert len(batch) == 8
    assert sorted(batch[:3]) == sorted(batch[3:6]) == [0, 1, 2]
    assert PromptSampler(3, 8, seed=0).batch(1)[:1] == PromptSampler(3, 3, seed=0).batch(2)[2:]


@pytest.mark.parametrize("args", [(0, 1, 0), (5, 0, 0), (5, 1, -1), (5.0, 1, 0), (5, True, 0)])
def test_sampler_rejects_bad_arguments(args):
    with pytest.raises(SparrowError, match="must be an integer"):
        PromptSampler(*args)


def test_sampler_rejects_bad_step():
    with pytest.raises(SparrowError, match="step must be an integer >= 0, got -1"):
        PromptSampler(4, 2, seed=0).batch(-1)
