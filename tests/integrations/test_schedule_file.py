"""The run-time schedule file of a TRL run: a new run starts the file over at version 1 whatever an earlier run
left in it, while a writer that would take the version back is refused."""

import pytest

from sparrow.errors import SparrowError
from sparrow.integrations.config import SparrowConfig
from sparrow.integrations.schedule_file import RunTimeSchedule
from sparrow.schedules import const, read_schedule_file, write_schedule_json
from sparrow.schedules.runtime import status_path


def test_a_new_run_starts_the_file_over_and_an_older_version_is_refused(tmp_path):
    path = tmp_path / "schedule.json"
    write_schedule_json(const(256), path, version=7)  # an earlier run's last version, and its report
    status_path(path).write_text('{"version": 7}')
    runtime = RunTimeSchedule(SparrowConfig(schedule="const:64"), path, 512, writer=True)
    runtime.start()
    assert read_schedule_file(path) == (const(64), 1) and not status_path(path).exists()
    write_schedule_json(const(128), path, version=3)  # e.g. another writer of the same file
    with pytest.raises(SparrowError, match=f"schedule file {str(path)!r} holds version 3; refusing to write version 1"):
        runtime.write()


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
