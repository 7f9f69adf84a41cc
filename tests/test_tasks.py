"""The built-in `records` prompts: long enough, reproducible, and answerable from the ledger."""

import json
import re

from sparrow.cli import main
from sparrow.models import tiny_tokenizer
from sparrow.tasks.records import make_prompts


def test_prompts_reach_the_requested_length_and_repeat_with_the_seed():
    tok = tiny_tokenizer()
    first = make_prompts(3, 600, seed=4, tokenizer=tok)
    assert first == make_prompts(3, 600, seed=4, tokenizer=tok)
    assert first != make_prompts(3, 600, seed=5, tokenizer=tok)
    for example in first:
        ids = tok.apply_chat_template(example["prompt"], add_generation_prompt=True, tokenize=True)
        assert len(ids["input_ids"] if hasattr(ids, "keys") else ids) >= 600


def test_the_answer_is_the_count_of_the_entry_asked_about():
    example = make_prompts(1, 300, seed=1, tokenizer=tiny_tokenizer())[0]
    text = example["prompt"][0]["content"]
    number, item, name, place = re.search(r"entry (\d+), how many (\w+) did (\w+) store in (the \w+)", text).groups()
    line = re.search(rf"Entry {number}: {name} stored (\d+) {item} in {place}\.", text)
    assert line and line.group(1) == example["answer"]


def test_the_command_writes_jsonl(tmp_path):
    out = tmp_path / "p.jsonl"
    assert main(["prompts", "--model", "tiny-llama", "--count", "2", "--min-tokens", "200", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all({"prompt", "answer"} <= set(r) for r in rows)
