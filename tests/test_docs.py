"""The documentation a newcomer reads: every relative link and image of README, BENCHMARKS, docs/ and the benchmark
history resolves (files, and headings for `#anchors`), README stays short, and the pictures regenerate from the
committed records with one command."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "benchmarks" / "history").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen = set(), {}
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            base = slug(line.lstrip("#"))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    for target in LINK.findall(text):
        if not re.match(r"[a-z]+://|mailto:", target):
            yield target


def test_slug_matches_github():
    assert slug("Round 3, session 9: machine and date") == "round-3-session-9-machine-and-date"
    assert slug("`sparrow train`") == "sparrow-train"
    assert slug("Tail or mean?") == "tail-or-mean"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading '{anchor}' in {dest.name})")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_readme_is_short_and_shows_the_pictures():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text) <= 16_000, f"README.md has {len(text)} characters; the reference belongs in docs/cli.md"
    for name in ("decode-speed.png", "reward-vs-rollout-time.png", "p5-vs-budget.png"):
        assert f"docs/img/{name}" in text


def test_benchmarks_is_a_summary():
    assert len((ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")) <= 30_000


def test_plots_regenerate_from_the_records(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "plots.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    for name in ("decode-speed.png", "reward-vs-rollout-time.png", "p5-vs-budget.png"):
        png = tmp_path / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
