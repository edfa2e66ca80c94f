"""The README's first screen and the docs' examples, run as written from a fresh clone after `make install`.

A fenced example marked runnable in its info string runs in a copy of the repository's files (what `git
ls-files` lists: what a clone holds) with the clone's `.venv/` (this checkout's) and its bin first on PATH:

- ```` ```sh runnable ````: the block as one bash script (`set -e`: the first command that fails stops it); it must
  exit 0;
- ```` ```console runnable ````: a transcript; each `$ ` line runs, exits 0 and prints exactly the lines shown under it.

Examples that need an engine, Docker, a cluster or Prometheus are not marked. The first screen's `make` commands
run through make itself where they need no engine; `make demo` starts the demo (tests/e2e/test_packaging.py serves
it from a wheel), so make only shows what it would run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from devtools import harness
from devtools.harness import PageServer, alternating, page

REPO = harness.REPO
README = REPO / "README.md"
DOCUMENTS = (README, *sorted((REPO / "docs").glob("*.md")))
RUNNABLE = re.compile(r"^```(?P<language>\w+) runnable\s*$")
LANGUAGES = ("sh", "console")
# The README up to its first section after the quick start: the newcomer's first screen.
FIRST_SCREEN_END = "## What pages you"
ENV = {**{k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")},
       "PATH": f"{REPO / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}


def runnable_examples() -> list[tuple[str, int, str, str]]:
    """(document, line of the fence, language, the block's text) of every example marked runnable."""
    examples = []
    for document in DOCUMENTS:
        lines = document.read_text().splitlines()
        for number, line in enumerate(lines):
            marked = RUNNABLE.match(line)
            if marked:
                end = next(i for i in range(number + 1, len(lines)) if lines[i].startswith("```"))
                examples.append((str(document.relative_to(REPO)), number + 1, marked["language"],
                                 "\n".join(lines[number + 1:end])))
    return examples


EXAMPLES = runnable_examples()


@pytest.fixture
def clone(tmp_path) -> Path:
    """The repository's files as a clone has them, and the virtual environment `make install` made."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    root = tmp_path / "kvcache-exporter"
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file() and not source.is_symlink():  # a deleted file still listed, a local symlink: not cloned
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / name)
    (root / ".venv").symlink_to(REPO / ".venv")
    return root


def run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)


def transcript(text: str) -> list[tuple[str, str]]:
    """(command, the output shown under it) of each `$ ` line."""
    steps: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        else:
            assert steps, f"output before the first command: {line!r}"
            steps[-1][1].append(line)
    return [(command, "\n".join(shown).rstrip("\n") + "\n") for command, shown in steps]


def test_the_readme_and_kv_math_carry_runnable_examples_in_known_languages():
    documents = {document for document, _, _, _ in EXAMPLES}
    assert {"README.md", "docs/kv-math.md"} <= documents
    assert {language for _, _, language, _ in EXAMPLES} <= set(LANGUAGES)


@pytest.mark.parametrize("example", EXAMPLES, ids=[f"{document}:{line}" for document, line, _, _ in EXAMPLES])
def test_each_runnable_example_runs_as_written(example, clone):
    document, line, language, text = example
    if language == "sh":
        result = run("set -e -o pipefail\n" + text, clone)
        assert result.returncode == 0, f"{document}:{line}: exit {result.returncode}\n{result.stderr}"
        return
    for command, shown in transcript(text):
        result = run(command, clone)
        assert result.returncode == 0, f"{document}:{line}: {command}: exit {result.returncode}\n{result.stderr}"
        assert result.stdout == shown, f"{document}:{line}: {command}"


def test_the_readme_examples_leave_what_they_say(clone):
    """The first screen's runnable block: `assets --out` writes the dashboards and the rules as committed."""
    (example,) = [text for document, _, _, text in EXAMPLES if document == "README.md"]
    assert run("set -e\n" + example, clone).returncode == 0
    written = clone / "kvcache-assets"
    for committed, out in (("alerts/kvcache-rules.yml", "alerts/kvcache-rules.yml"),
                           ("dashboards/generated/kvcache-fleet.json", "dashboards/kvcache-fleet.json")):
        assert (written / out).read_bytes() == (REPO / committed).read_bytes()


def first_screen_commands() -> list[str]:
    """The shell commands of the README's first screen: indented code lines and fenced sh lines."""
    screen = README.read_text().split(FIRST_SCREEN_END)[0]
    commands = re.findall(r"^    (\S.*)$", screen, re.M)
    for block in re.findall(r"^```sh[^\n]*\n(.*?)^```", screen, re.M | re.S):
        commands += block.splitlines()
    return commands


def test_the_newcomers_commands_are_make_demo_and_make_test_and_make_knows_them(clone):
    commands = first_screen_commands()
    # Exactly the two a newcomer needs; `make top` is named in the text beside them, not as a third command.
    assert [c for c in commands if c.startswith("make ")] == ["make demo", "make test"]
    assert "`make top` in a second terminal" in README.read_text().split(FIRST_SCREEN_END)[0]
    # What `make demo` and `make top` would run (the install, then the command); `make test` runs make again, which
    # even `make -n` would do, so make's database (`-p`, with -q on the default goal: nothing runs) shows the target.
    for target in ("demo", "top"):
        assert run(f"make --no-print-directory -n {target}", clone).stdout.splitlines()[-1].startswith(
            f".venv/bin/python -m kvcache_exporter {'--demo' if target == 'demo' else 'top'}"), target
    assert re.search(r"^test: deps$", run("make -pq", clone).stdout, re.M)
    # Every other first-screen command runs from the virtual environment: activated first, then its commands.
    others = [c for c in commands if not c.startswith("make ")]
    assert others[0] == "source .venv/bin/activate"
    assert all(c == others[0] or c.startswith("kvcache-exporter ") for c in others), others


def test_make_top_shows_the_exporters_pools_with_what_make_install_installed(clone):
    """`make top` against a stand-in for the demo's exporter (tests/fixtures/top/: two reads of a recorded page)
    on another port than 10490; `-o` keeps make from installing into this checkout's venv again."""
    pages = [(harness.FIXTURES / "top" / f"exporter-{n}.txt").read_text() for n in (1, 2)]
    with PageServer({"/metrics": alternating(page(pages[0]), page(pages[1]))}) as server:
        result = run(f"make -o .venv/.installed top TOP_ARGS='--exporter {server.url('')} --interval 0.1s'", clone)
    assert result.returncode == 0, result.stderr
    # Not a terminal: one plain table, the worst pool first (tests/fixtures/top/README.md).
    rows = [line.split() for line in result.stdout.splitlines()]
    assert ["sat", "0", "vllm", "llama-8b", "saturated"] in [row[:5] for row in rows], result.stdout
    # What `make install` runs in a clone without a venv yet: the editable install with the top extra (rich, which
    # the table needs; this checkout's venv has it from the test extra too).
    dry = run("make -n install VENV=.venv-new", clone)
    assert "install -q -e '.[top]'" in dry.stdout, dry.stdout


COMPOSE_COPIES = ("deploy/compose/prometheus/kvcache-rules.yml", "deploy/compose/prometheus/consoles/runbook.html",
                  "dashboards/generated/kvcache-fleet.json", "dashboards/generated/kvcache-target.json")


def test_make_compose_thresholds_writes_the_stacks_copies_for_its_exporters_file(clone):
    """docs/compose.md, "Thresholds": `make compose-thresholds` rewrites what the compose stack mounts (rules, runbook
    console, dashboards) for the exporter's file. For the shipped file, which overrides nothing, that is what is
    committed; for one with `high_water_ratio: 0.95`, all three say 95 % and none the default 90 %. `-o` keeps make
    from installing into this checkout's venv again (it has the dashboards' generator from the test extra)."""
    make = "make --no-print-directory -o .venv/.installed -o .venv/.installed-dashboards compose-thresholds"
    shipped = run(make, clone)
    assert shipped.returncode == 0, shipped.stderr
    for copy in COMPOSE_COPIES:
        assert (clone / copy).read_bytes() == (REPO / copy).read_bytes(), copy

    (clone / "mine.yml").write_text("pressure:\n  high_water_ratio: 0.95\n")
    mine = run(f"{make} COMPOSE_CONFIG=mine.yml", clone)
    assert mine.returncode == 0, mine.stderr
    rules = {rule["alert"]: rule for group in yaml.safe_load((clone / COMPOSE_COPIES[0]).read_text())["groups"]
             for rule in group["rules"] if "alert" in rule}
    assert rules["KVCacheNearlyFull"]["expr"].startswith("kvcache:usage_ratio:max >= 0.95\n")
    assert rules["KVCacheNearlyFull"]["annotations"]["runbook_url"] == (
        "{{ $externalURL }}/consoles/runbook.html#kvcachenearlyfull")
    runbook = (clone / COMPOSE_COPIES[1]).read_text()
    assert "high-water mark 95%" in runbook and "90%" not in runbook
    for board in COMPOSE_COPIES[2:]:
        steps = [step.get("value") for panel in _panels(json.loads((clone / board).read_text()))
                 for step in panel.get("fieldConfig", {}).get("defaults", {}).get("thresholds", {}).get("steps", ())]
        assert 0.95 in steps and 0.9 not in steps, board


def _panels(dashboard: dict):
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", ())
