"""KV-budget schedules: published preset values, bin lookup, every spec form, file round trip, errors, CLI."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from sparrow import schedules
from sparrow.errors import SparrowError
from sparrow.schedules import (
    DENSE,
    PRESETS,
    Schedule,
    const,
    page_bin_starts,
    parse_schedule,
    split_schedules,
    steps,
    write_schedule_json,
)

# KV budgets in tokens per 2000-token bin, written out independently of the loader (16 * (topk + 3)).
EXPECTED = {
    "qwen3-1.7b-0.75": [512, 512, 768, 768, 1024, 1024, 1280, 1280] + [1536] * 12,
    "qwen3-1.7b-0.80": [512, 768, 1024, 1280, 1536, 1536, 2048, 2048, 2048] + [2560] * 11,
    "qwen3-1.7b-0.83": [512, 1024, 1280, 1536, 2048, 2048, 2560, 2560] + [3072] * 12,
    "qwen3-1.7b-0.86": [512, 1024, 1536, 1536, 2048, 2560, 3072, 3584, 3584] + [4096] * 11,
    "qwen3-1.7b-0.88": [768, 1280, 2048, 2560, 2560, 3072, 3584, 4096, 4096] + [5120] * 11,
    "qwen3-1.7b-0.90": [768, 1536, 2560, 3072, 3584, 4096, 5120, 5120] + [6144] * 12,
    "qwen3-1.7b-0.92": [1024, 2048, 3072, 3584, 4096, 5120, 6144, 6144, 7168] + [8192] * 11,
    "qwen3-1.7b-0.94": [1280, 2560, 3584, 5120, 6144, 7168, 8192, 8192, 10240] + [12288] * 11,
    "qwen3-4b-0.75": [512] * 4 + [768, 1024, 1280, 1536] + [2048] * 4 + [2560] * 6 + [3072] * 2,
    "qwen3-4b-0.80": [512, 512, 768, 1024, 1280, 1536, 2048, 2560, 2560, 2560, 3072] + [3584] * 9,
    "qwen3-4b-0.86": [512, 768, 1024, 1280, 1536, 2048, 2560, 3584, 4096, 4096, 5120, 5120, 5120, 5120,
                      6144, 6144, 6144, 6144, 8192, 8192],
    "qwen3-4b-0.88": [512, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 7168, 7168, 8192, 8192, 8192]
                     + [10240] * 6,
    "qwen3-4b-0.90": [768, 1280, 2048, 2560, 3072, 4096, 5120, 7168, 10240] + [12288] * 6 + [14336] * 5,
    "qwen3-4b-0.92": [768, 1536, 2560, 3072, 4096, 6144, 7168, 12288, 14336, 16384, 16384] + [18432] * 9,
    "qwen3-8b-0.75": [512, 512, 512, 768, 768, 1280, 1280, 1280] + [1536] * 4 + [2048] * 6 + [2560] * 2,
    "qwen3-8b-0.80": [512, 512, 768, 1024, 1280, 1536, 2048, 2048, 2560, 2560, 3072, 3072, 3072]
                     + [3584] * 4 + [4096] * 3,
    "qwen3-8b-0.86": [512, 768, 1024, 1280, 2048, 2560, 3072] + [4096] * 4 + [5120] * 6 + [6208, 7168, 7168],
    "qwen3-8b-0.87": [512, 1024, 1280, 1536, 2560, 3072, 3584] + [5120] * 4 + [6144] * 5
                     + [7168, 7168, 8192, 8192],
    "qwen3-8b-0.92": [768, 1536, 2048, 3072, 4096, 7168, 8192, 10240, 12288, 12288, 12288] + [14336] * 5
                     + [16384] * 4,
    "qwen3-14b-0.86": [512, 768, 1280, 2048, 4096] + [6144] * 10 + [8192, 10240, 10240, 14336, 14336],
}
# The release keys bins by ceil(cached_len / 16) pages, 125 pages a bin: bin i starts at 2000 i - 15.
STARTS = (0,) + tuple(2000 * i - 15 for i in range(1, 20))
JSON_PATH = Path(schedules.__file__).parents[1] / "data" / "sparrow_schedules.json"
CLI_DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def _release_budget(topk: list[int], cached_len: int) -> int:
    """The release planner's rule, written independently: blocks = ceil(len / 16), bin i while 125 i <= blocks."""
    blocks = math.ceil(cached_len / 16)
    i = 0
    while i + 1 < len(topk) and 125 * (i + 1) <= blocks:
        i += 1
    return 16 * (topk[i] + 1 + 2)


def test_preset_4b_086_matches_spec():
    """SPEC section 4's worked example, verbatim."""
    assert list(PRESETS["qwen3-4b-0.86"].budgets) == [512, 768, 1024, 1280, 1536, 2048, 2560, 3584, 4096, 4096,
                                                       5120, 5120, 5120, 5120, 6144, 6144, 6144, 6144, 8192, 8192]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_preset_matches_published_values(name):
    schedule = PRESETS[name]
    assert schedule.name == name
    assert schedule.starts == STARTS
    assert list(schedule.budgets) == EXPECTED[name]
    schedule.validate(16, 3)
    assert parse_schedule(name) is schedule


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_preset_matches_the_release_planner_at_every_length(name):
    """Over cached lengths 1..45,000 the preset gives the release's budget; 2000 i would get 15 lengths per
    budget change wrong (60 to 165 per preset)."""
    topk = json.loads(JSON_PATH.read_text())["topk_pages"][name]
    lengths = list(range(1, 45_001))
    release = [_release_budget(topk, n) for n in lengths]
    assert PRESETS[name].budget_for(torch.tensor(lengths)).tolist() == release
    assert PRESETS[name].budget_for(np.array(lengths)).tolist() == release  # the vLLM plan's host-side path
    starts = PRESETS[name].starts
    edges = [n for s in starts[1:] for n in (s - 1, s, s + 1)]
    assert [PRESETS[name].budget_at(n) for n in edges] == [release[n - 1] for n in edges]
    by_2000 = Schedule("old", tuple(2000 * i for i in range(20)), PRESETS[name].budgets)
    wrong = sum(a != b for a, b in zip(by_2000.budget_for(torch.tensor(lengths)).tolist(), release))
    changes = sum(a != b for a, b in zip(EXPECTED[name], EXPECTED[name][1:]))
    assert wrong == 15 * changes and 60 <= wrong <= 165


def test_the_issue_example_and_page_bin_starts():
    assert PRESETS["qwen3-1.7b-0.92"].budget_at(1985) == 128 * 16 and PRESETS["qwen3-1.7b-0.92"].budget_at(1984) == 1024
    assert page_bin_starts(125, 16, 3) == (0, 1985, 3985)
    assert page_bin_starts(2, 4, 3) == (0, 5, 13)       # ceil(5 / 4) = 2 pages, ceil(13 / 4) = 4 pages
    assert page_bin_starts(125, 16, 1) == (0,)


def test_presets_agree_with_packaged_json():
    """Loader follows the JSON's own encoding: 20 names, budget = 16 * (topk + 1 sink + 2 local)."""
    data = json.loads(JSON_PATH.read_text())
    assert list(PRESETS) == list(data["topk_pages"])
    assert len(PRESETS) == 20 and set(PRESETS) == set(EXPECTED)
    for name, topk in data["topk_pages"].items():
        assert list(PRESETS[name].budgets) == [16 * (v + 3) for v in topk] == data["kv_budget_tokens"][name]
    assert PRESETS["qwen3-8b-0.86"].budgets[17] == 6208 == 16 * (385 + 3)
    assert max(PRESETS["qwen3-14b-0.86"].budgets) == 14336


def test_budget_for_bin_edges():
    schedule = PRESETS["qwen3-4b-0.86"]
    lengths = torch.tensor([[1, 1984, 1985, 2000], [3984, 3985, 35984, 35985], [39999, 40000, 10**6, 0]])
    out = schedule.budget_for(lengths)
    assert out.dtype == torch.int64 and out.shape == lengths.shape and out.device == lengths.device
    assert out.tolist() == [[512, 512, 768, 768], [768, 1024, 6144, 8192], [8192, 8192, 8192, 512]]
    assert schedule.budget_for(torch.tensor([1984, 1985], dtype=torch.int32)).tolist() == [512, 768]
    host = schedule.budget_for(lengths.numpy())
    assert isinstance(host, np.ndarray) and host.dtype == np.int64 and host.tolist() == out.tolist()
    assert [schedule.budget_at(n) for n in (1, 1984, 1985, 37985, 10**6)] == [512, 512, 768, 8192, 8192]


def test_budget_for_matches_budget_at_everywhere():
    schedule = steps(1000, [256, 512, 1024])
    lengths = torch.arange(0, 4001)
    assert schedule.budget_for(lengths).tolist() == [schedule.budget_at(n) for n in range(4001)]


def test_dense():
    assert DENSE.is_dense and not PRESETS["qwen3-4b-0.86"].is_dense
    assert DENSE.budget_at(5000) is None
    assert DENSE.to_json() == []
    assert parse_schedule("dense") is DENSE
    with pytest.raises(SparrowError, match="dense"):
        DENSE.budget_for(torch.tensor([1]))


def test_const_and_steps():
    assert const(512) == Schedule("const:512", (0,), (512,))
    assert parse_schedule("const:512") == const(512)
    assert parse_schedule("const:512").budget_for(torch.tensor([1, 10**6])).tolist() == [512, 512]
    schedule = parse_schedule("steps:1000:256,512,1024")
    assert schedule == steps(1000, [256, 512, 1024])
    assert schedule.starts == (0, 1000, 2000) and schedule.budgets == (256, 512, 1024)
    assert schedule.to_json() == [{"start": 0, "kv_budget": 256}, {"start": 1000, "kv_budget": 512},
                                  {"start": 2000, "kv_budget": 1024}]
    assert steps(777, [64, 128]).starts == (0, 777)


def test_explicit_pairs():
    schedule = parse_schedule("0:256, 2000:512,4000:1024")
    assert schedule.starts == (0, 2000, 4000) and schedule.budgets == (256, 512, 1024)
    assert schedule.budget_for(torch.tensor([1999, 2000, 3999, 4000, 9000])).tolist() == [256, 512, 512, 1024,
                                                                                            1024]


def test_split_schedules_keeps_comma_lists_of_one_spec_whole():
    assert split_schedules("const:256, const:512,dense") == ["const:256", "const:512", "dense"]
    assert split_schedules("steps:1000:256,512,0:48,const:64") == ["steps:1000:256,512,0:48", "const:64"]
    assert split_schedules("0:48,5:96,dense") == ["0:48,5:96", "dense"]
    assert split_schedules("0:256,2000:512; const:64 ;") == ["0:256,2000:512", "const:64"]
    assert split_schedules(" , ") == []


def test_json_file_forms(tmp_path):
    bins = [{"start": 0, "kv_budget": 256}, {"start": 3000, "kv_budget": 768}]
    as_list = tmp_path / "mine.json"
    as_list.write_text(json.dumps(bins))
    schedule = parse_schedule(str(as_list))
    assert schedule == Schedule("mine", (0, 3000), (256, 768))
    as_object = tmp_path / "obj.json"
    as_object.write_text(json.dumps({"name": "tuned", "page_size": 16, "bins": bins}))
    assert parse_schedule(str(as_object)) == Schedule("tuned", (0, 3000), (256, 768))
    no_name = tmp_path / "plain.json"
    no_name.write_text(json.dumps({"bins": bins}))
    assert parse_schedule(str(no_name)).name == "plain"


@pytest.mark.parametrize("schedule", [PRESETS["qwen3-8b-0.86"], steps(1000, [256, 512]), const(64), DENSE,
                                      parse_schedule("0:48,5:96")])
def test_write_then_parse_round_trip(tmp_path, schedule):
    path = write_schedule_json(schedule, tmp_path / "out" / "sched.json")
    data = json.loads(path.read_text())
    assert data == {"name": schedule.name, "page_size": 16, "bins": schedule.to_json()}
    assert parse_schedule(str(path)) == schedule
    assert [p.name for p in path.parent.iterdir()] == ["sched.json"]


def test_write_overwrites_and_honours_page_size(tmp_path):
    path = tmp_path / "s.json"
    write_schedule_json(const(96), path, page_size=32)
    write_schedule_json(const(128), path, page_size=32)
    assert parse_schedule(str(path), page_size=32) == const(128)
    with pytest.raises(SparrowError, match="page size 32.*page size 16 was requested"):
        parse_schedule(str(path))
    with pytest.raises(SparrowError, match="budget 48 .*page size 32"):
        write_schedule_json(const(48), path, page_size=32)


@pytest.mark.parametrize("schedule, message", [
    (const(100), "budget 100 is not a positive multiple of the page size 16"),
    (const(0), "budget 0 is not a positive multiple"),
    (const(-16), "budget -16 is not a positive multiple"),
    (const(32), r"budget 32 is below 48 tokens \(the 3 always-kept pages"),
    (Schedule("s", (0, 2000, 2000), (64, 128, 256)), "bin 2 starts at 2000, not after bin 1 at 2000; expected "
                                                     "strictly increasing"),
    (Schedule("s", (0, 3000, 2000), (64, 128, 256)), "bin 2 starts at 2000, not after bin 1 at 3000"),
    (Schedule("s", (16, 2000), (64, 128)), "first bin starts at 16; expected 0"),
])
def test_validation_errors(schedule, message):
    with pytest.raises(SparrowError, match=message):
        schedule.validate(16, 3)


def test_validation_errors_through_parse():
    with pytest.raises(SparrowError, match="bin 1 budget 520 is not a positive multiple of the page size 16"):
        parse_schedule("steps:1000:256,520")
    with pytest.raises(SparrowError, match="budget 64 is below 80 tokens"):
        parse_schedule("const:64", always_kept_pages=5)
    with pytest.raises(SparrowError, match="first bin starts at 10"):
        parse_schedule("10:256")
    with pytest.raises(SparrowError, match="preset 'qwen3-4b-0.86' is defined for page size 16, not 32"):
        parse_schedule("qwen3-4b-0.86", page_size=32)


def test_schedule_construction_errors():
    with pytest.raises(SparrowError, match="2 starts but 1 budgets"):
        Schedule("s", (0, 10), (64,))
    with pytest.raises(SparrowError, match="budget 64.5 is not an integer"):
        Schedule("s", (0,), (64.5,))
    with pytest.raises(SparrowError, match="steps bin size must be a positive number of tokens, got 0"):
        steps(0, [64])
    with pytest.raises(SparrowError, match="at least one budget"):
        steps(1000, [])


@pytest.mark.parametrize("spec, message", [
    ("foo", r"unknown schedule 'foo': expected 'dense', 'const:N', 'steps:BIN:b1,b2,...', 'start:budget,...', "
            r"a preset name \(qwen3-1.7b-0.75, .*qwen3-14b-0.86\) or a JSON file"),
    ("qwen3-4b-0.99", "unknown schedule 'qwen3-4b-0.99'"),
    ("", "unknown schedule ''"),
    ("const:1.5", "const budget '1.5' in schedule 'const:1.5' is not an integer"),
    ("const:", "const budget '' in schedule 'const:' is not an integer"),
    ("steps:1000", "bad steps schedule 'steps:1000': expected 'steps:BIN:b1,b2,...'"),
    ("steps:1e3:256", "steps bin size '1e3' in schedule 'steps:1e3:256' is not an integer"),
    ("steps:1000:256,x", "steps budget 'x' in schedule 'steps:1000:256,x' is not an integer"),
    ("0:256,2000-512", "bad bin '2000-512' in schedule '0:256,2000-512': expected 'start:budget'"),
    ("0:256,2000:5.5", "bin budget '5.5' in schedule '0:256,2000:5.5' is not an integer"),
])
def test_bad_specs(spec, message):
    with pytest.raises(SparrowError, match=message):
        parse_schedule(spec)


def test_bad_files(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(SparrowError, match=f"schedule file '{missing}' does not exist"):
        parse_schedule(str(missing))
    cases = {
        "broken.json": ("[{", "is not valid JSON"),
        "nobins.json": ('{"name": "x"}', "has no 'bins' key"),
        "scalar.json": ("5", "holds a int; expected a list"),
        "badbin.json": ('[{"start": 0}]', "bin 0 is {'start': 0}; expected"),
        "float.json": ('[{"start": 0, "kv_budget": 256.0}]', "bin 0 kv_budget 256.0 is not an integer"),
        "string.json": ('[{"start": "0", "kv_budget": 256}]', "bin 0 start '0' is not an integer"),
        "name.json": ('{"name": 3, "bins": []}', "name 3 is not a string"),
        "pagesize.json": ('{"page_size": 32, "bins": []}', "is for page size 32, but page size 16 was requested"),
        "order.json": ('[{"start": 0, "kv_budget": 256}, {"start": 0, "kv_budget": 512}]', "bin 1 starts at 0"),
    }
    for filename, (text, message) in cases.items():
        path = tmp_path / filename
        path.write_text(text)
        with pytest.raises(SparrowError, match=message):
            parse_schedule(str(path))


def test_cli_show_json(capsys):
    from sparrow.cli import main

    assert main(["schedule", "show", "qwen3-4b-0.86", "--json"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out) == [{"start": s, "kv_budget": b} for s, b in zip(STARTS, EXPECTED["qwen3-4b-0.86"])]
    assert main(["schedule", "show", "dense", "--json"]) == 0
    assert capsys.readouterr().out.strip() == "[]"


def test_cli_show_table(capsys):
    from sparrow.cli import main

    assert main(["schedule", "show", "steps:1000:256,512"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["bin", "from", "token", "to", "token", "KV", "budget", "(tokens)", "top-k", "pages"]
    assert lines[2].split() == ["0", "0", "1000", "256", "13"]
    assert lines[3].split() == ["1", "1000", "...", "512", "29"]
    assert main(["schedule", "show", "const:128", "--page-size", "32"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].split() == ["0", "0", "...", "128", "1"]
    assert main(["schedule", "show", "qwen3-1.7b-0.92"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert rows[:2] == [["0", "0", "1985", "1024", "61"], ["1", "1985", "3985", "2048", "125"]]
    assert rows[-1] == ["19", "37985", "...", "8192", "509"]


def test_cli_doc_lists_the_published_presets():
    """docs/cli.md's preset bullet names every model and target of the JSON, and no other."""
    text = CLI_DOC.read_text(encoding="utf-8")
    bullet = text[text.index("- a published preset"):]
    bullet = " ".join(bullet[:bullet.index("\n- ")].split())
    targets: dict[str, list[str]] = {}
    for name in json.loads(JSON_PATH.read_text())["topk_pages"]:
        model, target = name.rsplit("-", 1)
        targets.setdefault(model, []).append(target)
    listed = dict(re.findall(r"`(qwen3-[\d.]+b)` at ([\d., ]+\d)", bullet))
    assert {m: v.split(", ") for m, v in listed.items()} == targets
    assert "2000 i - 15" in bullet


def test_cli_errors(capsys):
    from sparrow.cli import main

    assert main(["schedule", "show", "foo"]) == 2
    err = capsys.readouterr().err
    assert "sparrow schedule: error: unknown schedule 'foo'" in err
    assert all(name in err for name in EXPECTED)
    assert main(["schedule", "show", "const:100"]) == 2
    assert "budget 100 is not a positive multiple of the page size 16" in capsys.readouterr().err


def test_budgets_must_hold_the_default_sparse_configs_always_kept_pages():
    with pytest.raises(SparrowError, match="always-kept"):
        schedules.parse_schedule("const:32")  # two pages of 16 cannot hold the three kept ones
