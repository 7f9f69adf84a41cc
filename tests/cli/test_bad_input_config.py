"""Bad `--config` files end like every other bad input (tests/cli/test_bad_input.py): exit code 2 and one line
`sparrow CMD: error: ...` on stderr naming the problem, before any model is loaded."""

import subprocess
import sys
import time

import pytest

from sparrow.cli import main
from sparrow.errors import SparrowError
from sparrow.typed_config import load_yaml
from tests.cli.test_bad_input import no_model_loading  # noqa: F401 (the fixture)

BOMB = ('a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n'
        + "".join(f"{name}: &{name} [{', '.join([f'*{last}'] * 9)}]\n" for last, name in zip("abcdefgh", "bcdefghi"))
        + "reward: *i\n")  # "billion laughs": 9**9 strings once the aliases expand

# (id, YAML text, text the message must hold)
CASES = [
    ("key-twice", "steps: 1\nsteps: 2\n", ("cfg.yaml', line 2, column 1: key 'steps' is given twice in one mapping "
                                          "(first on line 1)")),
    ("section-twice", "grpo:\n  steps: 1\nmodel: tiny-qwen3\ngrpo:\n  learning_rate: 1.0e-4\n",
     "line 4, column 1: key 'grpo' is given twice in one mapping (first on line 1)"),
    ("key-twice-in-section", "grpo:\n  steps: 1\n  steps: 2\n", "line 3, column 3: key 'steps' is given twice"),
    ("flat-and-nested", "learning_rate: 0.5\ngrpo: {learning_rate: 1e-4}\n",
     "'learning_rate' and 'grpo.learning_rate' both set learning_rate; give one of them"),
    ("alias-bomb", BOMB, "line 2, column 8: YAML aliases (*a) are not supported in config files"),
    ("invalid-yaml", "grpo:\n  steps: 1\n learning_rate: 2\n",
     "is not valid YAML: line 3, column 2: expected <block end>, but found '<block mapping start>'"),
    ("unknown-nested", "grpo: {learnin_rate: 1.0e-4}\n",
     "unknown option 'grpo.learnin_rate'; did you mean learning_rate? (`sparrow train --help` lists every option)"),
    ("unknown-flat", "learnin_rate: 1.0e-4\n", "unknown option 'learnin_rate'; did you mean learning_rate?"),
    ("option-in-wrong-section", "grpo: {temperature: 1.0}\n",
     "unknown option 'grpo.temperature'; did you mean sampling.temperature?"),
    ("section-not-mapping", "grpo: 3\n", "section 'grpo' must be a mapping of its options, got 3"),
]


@pytest.mark.usefixtures("no_model_loading")
@pytest.mark.parametrize("text, message", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_a_bad_config_file_is_one_line_and_exit_code_2(text, message, tmp_path, capsys):
    config = tmp_path / "cfg.yaml"
    config.write_text(text)
    code = main(["train", "--config", str(config), "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("sparrow train: error: config file "), err
    assert message in lines[0] and "Traceback" not in err
    assert len(lines[0]) < 300 and not (tmp_path / "out").exists()


def test_an_unknown_option_lists_no_more_than_the_closest_names(tmp_path, capsys):
    config = tmp_path / "cfg.yaml"
    config.write_text("zzzz: 1\n")
    assert main(["generate", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err == (f"sparrow generate: error: config file {str(config)!r}: unknown option 'zzzz' "
                   "(`sparrow generate --help` lists every option)\n")


def test_the_alias_bomb_is_refused_at_once(tmp_path):
    config = tmp_path / "bomb.yaml"
    config.write_text(BOMB)
    assert len(BOMB) < 500
    start = time.perf_counter()
    with pytest.raises(SparrowError, match=r"YAML aliases \(\*a\) are not supported"):
        load_yaml(config)
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("text", ["1e-4", "5E-7", "1.0e+3", "1e4", "1.0e-06"])
def test_yaml_numbers_with_an_exponent_are_floats(text, tmp_path):
    config = tmp_path / "cfg.yaml"
    config.write_text(f"grpo:\n  learning_rate: {text}\n")
    assert load_yaml(config) == {"grpo": {"learning_rate": float(text)}}


def test_a_config_with_1e_minus_4_reaches_the_next_check(tmp_path, capsys):
    """The README's `learning_rate: 1e-4` is a number: the run stops only at the missing data."""
    config = tmp_path / "cfg.yaml"
    config.write_text("learning_rate: 1e-4\nsampling: {temperature: 5E-1}\n")
    assert main(["train", "--config", str(config), "--output-dir", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == "sparrow train: error: give the prompt data: --data FILE.jsonl|.parquet\n"


def test_a_closed_stdout_at_start_is_one_line_and_exit_code_2():
    """`sparrow schedule show dense >&-`: Python starts with sys.stdout None; refused before any work."""
    run = "import sys; from sparrow.cli import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run(["bash", "-c", '"$0" -c "$1" schedule show dense >&-', sys.executable, run],
                          stderr=subprocess.PIPE, text=True, timeout=300, check=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr == ("sparrow schedule: error: standard output is closed; redirect it to a file or /dev/null "
                           "instead\n")
