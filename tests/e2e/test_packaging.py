"""What ships, and that it works away from the repository: the wheel and the container image each install one
import package, kvcache_exporter, which serves the demo and writes out the dashboards, rules, Alertmanager example
and runbook the repository commits, byte for byte.

No Docker engine runs here, so the image's build stage is replayed as its Dockerfile says: a build context holding
what .dockerignore lets through, the build stage's COPY lines, then its `pip install /src` into a fresh virtualenv.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from devtools import harness

REPO = harness.REPO
# Output path of `kvcache-exporter assets` -> the committed file it must equal byte for byte.
COMMITTED = {
    "dashboards/kvcache-fleet.json": "dashboards/generated/kvcache-fleet.json",
    "dashboards/kvcache-target.json": "dashboards/generated/kvcache-target.json",
    "alerts/kvcache-rules.yml": "alerts/kvcache-rules.yml",
    "alerts/alertmanager.yml": "alerts/alertmanager.yml",
    "alerts/runbook.md": "alerts/runbook.md",
}
# What a fresh clone holds: no virtual environment, build leftovers or caches of this checkout.
NOT_IN_A_CLONE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__",
                                        ".pytest_cache", ".hypothesis", "node_modules", "bench", "fuzz")
# An empty PYTHONPATH adds nothing (harness.Process merges its env into the environment, so unset is not enough).
ENV = {**{key: value for key, value in os.environ.items() if key != "VIRTUAL_ENV"}, "PYTHONPATH": ""}


def run(argv: list, cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run([str(a) for a in argv], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{argv}: {result.stderr}"
    return result


def venv_with(tmp: Path, name: str, *requirements) -> Path:
    """A new virtualenv with `requirements` installed by pip; returns its bin directory."""
    run([sys.executable, "-m", "venv", tmp / name], tmp)
    run([tmp / name / "bin" / "python", "-m", "pip", "install", "-q", *requirements], tmp)
    return tmp / name / "bin"


def assets_written_by(bin_dir: Path, where: Path) -> dict[str, bytes]:
    where.mkdir()
    run([bin_dir / "kvcache-exporter", "assets", "--out", "out"], where)
    return {str(path.relative_to(where / "out")): path.read_bytes()
            for path in sorted((where / "out").rglob("*")) if path.is_file()}


def installed_top_level(bin_dir: Path, where: Path) -> set[str]:
    """The first path component, inside site-packages, of every file pip recorded for the distribution."""
    listing = run([bin_dir / "python", "-c", "from importlib.metadata import files; "
                   "print('\\n'.join(str(f) for f in files('kvcache-exporter')))"], where).stdout.split()
    return {Path(name).parts[0] for name in listing if not name.startswith("..")}


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("clone") / "kvcache-exporter"
    shutil.copytree(REPO, source, ignore=NOT_IN_A_CLONE)
    return source


@pytest.fixture(scope="module")
def wheel(clone, tmp_path_factory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", dist, clone], dist)
    (built,) = dist.glob("kvcache_exporter-*.whl")
    return built


def test_the_wheel_holds_one_import_package_with_its_assets(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top_level == {"kvcache_exporter"}
    expected_data = {"kvcache_exporter/dashboards/generated/kvcache-fleet.json",
                     "kvcache_exporter/dashboards/generated/kvcache-target.json",
                     "kvcache_exporter/alerts/kvcache-rules.yml", "kvcache_exporter/alerts/alertmanager.yml",
                     "kvcache_exporter/alerts/runbook.md", "kvcache_exporter/alerts/runbook.template.md"}
    assert expected_data <= set(names)
    # The generators ship (assets --config rebuilds with them); the development tools and promtool tests do not.
    assert {"kvcache_exporter/dashboards/build.py", "kvcache_exporter/alerts/generate.py",
            "kvcache_exporter/alerts/rules/fleet.py",
            "kvcache_exporter/alerts/runbook.py", "kvcache_exporter/simulator/server.py"} <= set(names)
    assert not [name for name in names if re.search(r"(^|/)(devtools|tests|lint|preview|contract_doc)\b", name)]
    # The compiled reader and fold, built where the wheel was (a C compiler is here).
    for module in (r"sources/cparser", r"adapters/cfold"):
        assert len([name for name in names if re.fullmatch(rf"kvcache_exporter/{module}\.[\w.-]+\.so", name)]) == 1


def compiled_of(bin_dir: Path, where: Path) -> str:
    """Which page reader and which fold of the samples run: `cython cython` where both were compiled."""
    return run([bin_dir / "python", "-c", "from kvcache_exporter import adapters; from kvcache_exporter.sources "
                "import parser; print(parser.READER, adapters.ADAPTER)"], where).stdout.strip()


def test_without_a_c_compiler_the_install_runs_the_reference_reader_and_fold(clone, tmp_path):
    """The compiled reader and fold are optional: with no compiler (CC fails) pip still installs, and the pure-Python
    reader and fold run and say so."""
    run([sys.executable, "-m", "venv", tmp_path / "venv"], tmp_path)
    bin_dir = tmp_path / "venv" / "bin"
    source = tmp_path / "src"
    shutil.copytree(clone, source, ignore=NOT_IN_A_CLONE)  # not the wheel fixture's build/, compiled already
    result = subprocess.run([bin_dir / "python", "-m", "pip", "install", "-q", source], cwd=tmp_path,
                            env={**ENV, "CC": "false", "CXX": "false"}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert compiled_of(bin_dir, tmp_path) == "python python"
    assert not list((tmp_path / "venv").rglob("cparser*.so")) and not list((tmp_path / "venv").rglob("cfold*.so"))
    written = assets_written_by(bin_dir, tmp_path / "out")
    assert set(written) == set(COMMITTED)


def test_a_wheel_install_serves_the_demo_and_writes_the_committed_assets(wheel, tmp_path):
    bin_dir = venv_with(tmp_path, "venv", wheel)
    elsewhere = tmp_path / "elsewhere"
    assert installed_top_level(bin_dir, tmp_path) == {"kvcache_exporter", wheel.name.split("-")[0] + "-"
                                                      + wheel.name.split("-")[1] + ".dist-info"}

    written = assets_written_by(bin_dir, elsewhere)
    assert set(written) == set(COMMITTED)
    for output, committed in COMMITTED.items():
        assert written[output] == (REPO / committed).read_bytes(), output
    assert compiled_of(bin_dir, tmp_path) == "cython cython"

    # Without the dashboards extra, rebuilding for a configuration says which extra to install.
    config = elsewhere / "exporter.yml"
    config.write_text("pressure: {high_water_ratio: 0.8}\n")
    rebuilt = subprocess.run([bin_dir / "kvcache-exporter", "assets", "--out", "rebuilt", "--config", config],
                             cwd=elsewhere, env=ENV, capture_output=True, text=True, timeout=120)
    assert (rebuilt.returncode, rebuilt.stdout) == (2, "")
    assert rebuilt.stderr == ("kvcache-exporter assets: --config: rebuilding the dashboards needs "
                              "grafana-foundation-sdk: pip install 'kvcache-exporter[dashboards]'\n")

    port = harness.free_port()
    with harness.Process("demo", [str(bin_dir / "kvcache-exporter"), "--demo", "--listen", f"127.0.0.1:{port}"],
                         tmp_path, f"http://127.0.0.1:{port}/healthz", env=ENV, cwd=elsewhere) as demo:
        demo.wait_ready()
        harness.wait_until(lambda: {"demo-vllm", "demo-sglang", "demo-trtllm"} <= {
            dict(key[1])["target"] for key in harness.series(harness.scrape(f"http://127.0.0.1:{port}"),
                                                             "kvcache_usage_ratio")}, 60,
            what="every simulated engine's usage in the demo's /metrics")
        build_info = harness.series(harness.scrape(f"http://127.0.0.1:{port}"), "kvcache_exporter_build_info")
        assert [(dict(key[1])["reader"], dict(key[1])["adapter"]) for key in build_info] == [("cython", "cython")]


def docker_ignored(relative: str, patterns: list[tuple[bool, str]]) -> bool:
    """Whether .dockerignore keeps `relative` out of the build context: the last pattern that matches the path or one
    of its parent directories decides (`*` stays within one path component, `**` crosses them)."""
    def matches(path: str, pattern: str) -> bool:
        regex = "".join(".*" if part == "**" else fnmatch.translate(part)[4:-3].replace(".*", "[^/]*")
                        for part in re.split(r"(\*\*)", pattern))
        return re.fullmatch(regex, path) is not None

    parts = relative.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for negated, pattern in patterns:
        if any(matches(candidate, pattern) for candidate in candidates):
            ignored = not negated
    return ignored


def image_build_stage(clone: Path, src: Path) -> list[str]:
    """Lays out /src as the Dockerfile's build stage does; returns the arguments of its `pip install`."""
    patterns = []
    for line in (clone / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            patterns.append((line.startswith("!"), line.lstrip("!").rstrip("/")))
    context = {path.relative_to(clone).as_posix() for path in clone.rglob("*") if path.is_file()}
    context = {relative for relative in context if not docker_ignored(relative, patterns)}
    build_stage = (clone / "Dockerfile").read_text().split("\nFROM ")[1]
    for sources, destination in re.findall(r"^COPY (.+) (\S+)$", build_stage, flags=re.M):
        for source in sources.split():
            files = [relative for relative in context if relative == source or relative.startswith(source + "/")]
            assert files, f"COPY {source}: nothing of it is in the build context"
            for relative in files:
                target = src / (relative if destination in ("./", ".") else
                                Path(destination.removeprefix("./")) / Path(relative).relative_to(source))
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(clone / relative, target)
    (install,) = re.findall(r"pip install --no-cache-dir (\S+)$", build_stage, flags=re.M)
    assert install == "/src"
    return [str(src)]


def test_the_image_installs_the_same_package_and_writes_the_same_assets(clone, wheel, tmp_path):
    """`kvcache-exporter assets` from the image's filesystem gives what the wheel gives (it used to fail there)."""
    requirement = image_build_stage(clone, tmp_path / "src")
    image = venv_with(tmp_path, "image", *requirement)
    from_image = assets_written_by(image, tmp_path / "image-out")
    assert set(from_image) == set(COMMITTED)
    for output, committed in COMMITTED.items():
        assert from_image[output] == (REPO / committed).read_bytes(), output
    assert installed_top_level(image, tmp_path) == {"kvcache_exporter", "kvcache_exporter-0.1.0.dist-info"}
    assert compiled_of(image, tmp_path) == "cython cython"
    # The same files as the wheel's, module for module.
    installed = run([image / "python", "-c", "from importlib.metadata import files; "
                     "print('\\n'.join(sorted(str(f) for f in files('kvcache-exporter') "
                     "if str(f).startswith('kvcache_exporter/') and '__pycache__' not in str(f))))"], tmp_path)
    assert set(installed.stdout.split()) == {name for name in zipfile.ZipFile(wheel).namelist()
                                             if name.startswith("kvcache_exporter/")}
