"""The run-time schedule file of a TRL run: a new run starts one version above whatever an earlier run left in the
file or its report (a server following the file across runs never sees a version go back), while a writer that would
take the version back is refused."""

import json

import pytest

from sparrow.errors import SparrowError
from sparrow.integrations.config import SparrowConfig
from sparrow.integrations.schedule_file import RunTimeSchedule
from sparrow.schedules import const, read_schedule_file, write_schedule_json
from sparrow.schedules.runtime import status_path


@pytest.mark.parametrize("file_version, reported, expected", [(None, None, 1), (7, 7, 8), (7, 9, 10), (4, None, 5),
                                                               (None, 3, 4)])
def test_a_new_run_starts_above_every_version_an_earlier_run_left(file_version, reported, expected, tmp_path):
    path = tmp_path / "schedule.json"
    if file_version is not None:  # an earlier run's last version
        write_schedule_json(const(256), path, version=file_version)
    if reported is not None:  # what a server following the file across runs last put in force
        status_path(path).write_text(json.dumps({"version": reported}))
    runtime = RunTimeSchedule(SparrowConfig(schedule="const:64"), path, 512, writer=True)
    runtime.start()
    assert read_schedule_file(path) == (const(64), expected) and not status_path(path).exists()
    other = RunTimeSchedule(SparrowConfig(schedule="const:64"), path, 512, writer=False)
    other.join()  # another process of the run, after the writer
    assert other.version == runtime.version == expected


def test_a_server_following_the_file_across_runs_takes_the_next_runs_schedule(tmp_path):
    """A long-running server (the plugin's follower) holds version 7 of an earlier run: the next run's first
    schedule is put in force, not refused as a version going back."""
    from sparrow.vllm.env import from_environment
    from sparrow.vllm.state import PluginState

    path = tmp_path / "schedule.json"
    write_schedule_json(const(256), path, version=7)
    server = PluginState()
    server.activate(from_environment({"SPARROW_VLLM_SCHEDULE": f"@{path}"}))
    assert server.active().version == 7
    RunTimeSchedule(SparrowConfig(schedule="const:64"), path, 512, writer=True).start()
    in_force = server.active()
    assert (in_force.schedule.budgets, in_force.version) == ((64,), 8)


def test_a_writer_taking_the_version_back_is_refused(tmp_path):
    path = tmp_path / "schedule.json"
    runtime = RunTimeSchedule(SparrowConfig(schedule="const:64"), path, 512, writer=True)
    runtime.start()
    write_schedule_json(const(128), path, version=3)  # e.g. another writer of the same file
    with pytest.raises(SparrowError, match=f"schedule file {str(path)!r} holds version 3; refusing to write version 1"):
        runtime.write()


def test_a_damaged_report_of_an_earlier_run_holds_no_version(tmp_path):
    path = tmp_path / "schedule.json"
    status_path(path).write_text("{not json")
    runtime = RunTimeSchedule(SparrowConfig(schedule="const:64"), path, 512, writer=True)
    runtime.start()
    assert read_schedule_file(path) == (const(64), 1) and not status_path(path).exists()


def test_joining_before_the_writer_started_the_file_is_refused(tmp_path):
    path = tmp_path / "schedule.json"
    with pytest.raises(SparrowError, match="holds no version after the run's writer started it"):
        RunTimeSchedule(SparrowConfig(schedule="const:64"), path, 512, writer=False).join()


def test_the_server_mode_recipe_a_server_follows_the_file_schedule_show_wrote_and_the_trainer_overwrites(
        tmp_path, capsys):
    """docs/trl.md, server mode: `sparrow schedule show SPEC --json > FILE`, a server started with
    SPARROW_VLLM_SCHEDULE=@FILE (its own process; here a PluginState as the server's), then the trainer starts the
    file over with its own schedule: the server's next engine step puts it in force and reports it back."""
    from sparrow.cli import main
    from sparrow.vllm.env import from_environment
    from sparrow.vllm.state import PluginState

    path = tmp_path / "schedule.json"
    assert main(["schedule", "show", "const:512", "--json"]) == 0
    path.write_text(capsys.readouterr().out)
    server = PluginState()
    server.activate(from_environment({"SPARROW_VLLM_SCHEDULE": f"@{path}"}))
    assert server.active().schedule.budgets == (512,)
    trainer = RunTimeSchedule(SparrowConfig(schedule="const:256", schedule_file=str(path)), path, 4096, writer=True)
    trainer.start()
    in_force = server.active()  # the server's next engine step
    assert (in_force.schedule.budgets, in_force.version) == ((256,), 1)
    schedule, version, warnings = trainer.in_force()
    assert (schedule.budgets, version, warnings) == ((256,), 1, [])
