"""The run-time schedule file of a TRL run: a new run starts the file over at version 1 whatever an earlier run
left in it, while a writer that would take the version back is refused (issue 36)."""

import pytest

from sparrow.errors import SparrowError
from sparrow.integrations.config import SparrowConfig
from sparrow.integrations.schedule_file import RunTimeSchedule
from sparrow.schedules import const, read_schedule_file, write_schedule_json
from sparrow.vllm.status import status_path


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
