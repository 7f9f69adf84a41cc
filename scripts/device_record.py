"""The one JSON file of a device check (scripts/device_check.py): the machine, each step of each section (its
result, or its error, or that it was skipped) and the engine's numbered checks; written after every step and check,
so a run cut short keeps what it did. Steps start only before the deadline, and a child process's timeout ends at
it (`seconds_left`)."""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path

SUMMARY: dict = {"machine": {}, "steps": {}, "checks": []}
PATH = Path("runs/device-check/device_check.json")
START = time.perf_counter()
DEADLINE = 0.0  # seconds after START past which no step starts and no child process runs on (0: none)
CURRENT = ""  # the step running


def save() -> None:
    PATH.parent.mkdir(parents=True, exist_ok=True)
    PATH.write_text(json.dumps(SUMMARY, indent=1, default=str) + "\n")


def elapsed() -> float:
    return time.perf_counter() - START


def past_deadline() -> bool:
    return bool(DEADLINE) and elapsed() >= DEADLINE


def seconds_left(limit: float) -> float:
    """`limit`, or the seconds to the deadline where that is sooner (at least one)."""
    return limit if not DEADLINE else max(1.0, min(limit, DEADLINE - elapsed()))


def progress(record: dict) -> None:
    """What the running step has so far (its runs, say), saved: the step's result replaces it when it ends."""
    SUMMARY["steps"][CURRENT] = {"running": True, **record}
    save()


def check(name: str, value: float, limit: float) -> None:
    """A numbered check of the engine section: PASS when `value` <= `limit`."""
    ok = value <= limit
    SUMMARY["checks"].append({"check": name, "value": value, "limit": limit, "ok": ok})
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {value:.3g} (limit {limit:g})", flush=True)
    save()


def failed(name: str, err: BaseException) -> None:
    """Record a check that raised: FAIL with the error and the end of its traceback."""
    text = "".join(traceback.format_exception(err)).strip().splitlines()
    SUMMARY["checks"].append({"check": name, "error": f"{type(err).__name__}: {err}", "traceback": text[-12:],
                              "ok": False})
    print(f"FAIL  {name}: raised {type(err).__name__}: {err}", flush=True)
    print("      " + "\n      ".join(text[-12:]), flush=True)
    save()


def run_step(name: str, fn) -> None:
    """Run one step unless past the deadline, recording its result (a dict; "ok": False marks a failure it did not
    raise) or its error under `name`; the step fails too if a check it made failed. The next step still runs."""
    if past_deadline():
        SUMMARY["steps"][name] = {"skipped": f"past the deadline ({DEADLINE:g} s; --deadline 0 runs every step)"}
        print(f"SKIP  {name}: past the deadline", flush=True)
        save()
        return
    global CURRENT
    CURRENT, start, checks = name, time.perf_counter(), len(SUMMARY["checks"])
    try:
        record = {"ok": True, **(fn() or {})}
    except Exception as err:  # noqa: BLE001 - every failure is reported, the next step still runs
        record = {"ok": False, "error": f"{type(err).__name__}: {err}"[:2000],
                  "traceback": traceback.format_exc()[-3000:]}
    record["ok"] = record["ok"] and all(c["ok"] for c in SUMMARY["checks"][checks:])
    record["seconds"] = round(time.perf_counter() - start, 2)
    SUMMARY["steps"][name] = record
    print(f"{'PASS' if record['ok'] else 'FAIL'}  {name} ({record['seconds']:.0f} s)", flush=True)
    save()
