"""TLS and basic auth for the exporter's own endpoint, from a web configuration file in the
format of Prometheus' exporter-toolkit (`--web.config.file`), so the same file serves the node
exporter and this one."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import ssl
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import bcrypt

from ..config import ConfigError, key_name, read_yaml
from ..sources.fetch import FileProblem, read_certificates, read_text, ssl_problem

CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "RequestClientCert": ssl.CERT_OPTIONAL,
    "RequireAnyClientCert": ssl.CERT_REQUIRED,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
TLS_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
                "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
_BCRYPT = re.compile(r"^\$2[aby]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}$")
_TOP_KEYS = ("tls_server_config", "basic_auth_users", "http_server_config")
_TLS_KEYS = ("cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version", "max_version")
# The headers the exporter-toolkit lets a web configuration add to every response.
EXTRA_HEADERS = ("Strict-Transport-Security", "X-Content-Type-Options", "X-Frame-Options", "X-XSS-Protection",
                 "Content-Security-Policy")


@dataclass
class WebConfig:
    tls: ssl.SSLContext | None = None
    users: dict[str, bytes] = field(default_factory=dict)  # user -> bcrypt hash
    headers: dict[str, str] = field(default_factory=dict)  # added to every response (http_server_config.headers)
    # Checked instead of a user's hash for an unknown user name, at the same bcrypt cost: an
    # unknown name then takes as long as a known one with a wrong password, so timing tells no names.
    _dummy_hash: bytes = b""
    # bcrypt is slow on purpose; remember credentials that passed so each scrape does not pay for it.
    _verified: set[bytes] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def authorized(self, header: str | None) -> bool:
        """Whether an Authorization header passes; blocks for one bcrypt check (run it in a worker thread)."""
        if not self.users:
            return True
        if not header or not header.startswith("Basic "):
            return False
        try:
            user, _, password = base64.b64decode(header[6:], validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        known = user in self.users
        hashed = self.users[user] if known else self._dummy_hash
        token = hashlib.sha256(user.encode() + b"\0" + password.encode() + b"\0" + hashed).digest()
        with self._lock:
            if known and token in self._verified:
                return True
        if not bcrypt.checkpw(password.encode(), hashed) or not known:
            return False
        with self._lock:
            if len(self._verified) > 1024:
                self._verified.clear()
            self._verified.add(token)
        return True


def load(path: str) -> WebConfig:
    """Raises ConfigError naming the file and key."""
    data = read_yaml(path) or {}
    if not isinstance(data, dict):
        raise ConfigError(path, "(top level)", "must be a mapping")
    _reject_unknown(path, "", data, _TOP_KEYS)
    web = WebConfig()
    if data.get("tls_server_config"):
        web.tls = _tls_context(path, data["tls_server_config"])
    users = data.get("basic_auth_users") or {}
    if not isinstance(users, dict):
        raise ConfigError(path, "basic_auth_users", "must be a mapping of user names to bcrypt hashes")
    for user, hashed in users.items():
        if not isinstance(hashed, str) or not _BCRYPT.match(hashed):
            raise ConfigError(path, f"basic_auth_users.{key_name(user)}", "must be a bcrypt hash ($2y$...)")
        web.users[str(user)] = hashed.encode()
    if web.users:
        cost = max(int(hashed[4:6]) for hashed in web.users.values())
        web._dummy_hash = bcrypt.hashpw(b"no such user", bcrypt.gensalt(rounds=cost))
    if data.get("http_server_config") is not None:
        web.headers = _http_server_config(path, data["http_server_config"])
    return web


def _reject_unknown(path: str, section: str, mapping: dict, known: tuple[str, ...]) -> None:
    for key in mapping:
        if key not in known:
            raise ConfigError(path, f"{section}{key_name(key)}", f"unknown key (known: {', '.join(known)})")


def _http_server_config(path: str, section: Any) -> dict[str, str]:
    if not isinstance(section, dict):
        raise ConfigError(path, "http_server_config", "must be a mapping")
    _reject_unknown(path, "http_server_config.", section, ("http2", "headers"))
    if section.get("http2", False) is not False:
        raise ConfigError(path, "http_server_config.http2", "this exporter serves HTTP/1.1 only: set it to false "
                                                             "or remove it")
    headers = section.get("headers") or {}
    if not isinstance(headers, dict):
        raise ConfigError(path, "http_server_config.headers", "must be a mapping of header names to values")
    allowed = {name.lower(): name for name in EXTRA_HEADERS}
    out = {}
    for name, value in headers.items():
        key = f"http_server_config.headers.{key_name(name)}"
        if str(name).lower() not in allowed:
            raise ConfigError(path, key, f"not a header this file may set (one of {', '.join(EXTRA_HEADERS)})")
        if not isinstance(value, str) or not value or any(c in value for c in "\r\n"):
            raise ConfigError(path, key, "must be a one-line string")
        out[allowed[str(name).lower()]] = value
    return out


def _tls_context(path: str, section: Any) -> ssl.SSLContext:
    if not isinstance(section, dict):
        raise ConfigError(path, "tls_server_config", "must be a mapping")
    _reject_unknown(path, "tls_server_config.", section, _TLS_KEYS)
    auth_type = section.get("client_auth_type", "NoClientCert")
    if not isinstance(auth_type, str) or auth_type not in CLIENT_AUTH:
        raise ConfigError(path, "tls_server_config.client_auth_type",
                          f"must be one of {', '.join(CLIENT_AUTH)}, got {auth_type!r}")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = _tls_version(path, section, "min_version", "TLS12")
    context.maximum_version = _tls_version(path, section, "max_version", "TLS13")
    if context.minimum_version > context.maximum_version:
        raise ConfigError(path, "tls_server_config.max_version", "is below min_version")
    cert_file, _ = _file(path, section, "cert_file", read_certificates)
    key_file, _ = _file(path, section, "key_file", read_text)
    try:  # the certificate was read above: what fails now is the key
        context.load_cert_chain(cert_file, key_file)
    except ssl.SSLError as err:
        raise ConfigError(path, "tls_server_config.key_file",
                          f"{key_file} is not the PEM private key of {cert_file}: {ssl_problem(err)}") from None
    context.verify_mode = CLIENT_AUTH[auth_type]
    if auth_type in ("VerifyClientCertIfGiven", "RequireAndVerifyClientCert") or section.get("client_ca_file"):
        if not section.get("client_ca_file"):
            raise ConfigError(path, "tls_server_config.client_ca_file", f"is required with {auth_type}")
        context.load_verify_locations(cadata=_file(path, section, "client_ca_file", read_certificates)[1])
    return context


def _file(path: str, section: dict, key: str, read: Callable[[str], str]) -> tuple[str, str]:
    """(the file path under `key`, its text as `read` checks it: a reader of sources.fetch). A relative path is
    taken from the web configuration file's directory, as the Prometheus exporters' web configuration does."""
    value = section.get(key)
    if not isinstance(value, str) or not value:
        raise ConfigError(path, f"tls_server_config.{key}", f"is required: a file path, got {value!r}")
    value = os.path.join(os.path.dirname(path), value)  # an absolute value stays as it is
    try:
        return value, read(value)
    except FileProblem as err:
        raise ConfigError(path, f"tls_server_config.{key}", str(err)) from None


def _tls_version(path: str, section: dict, key: str, default: str) -> ssl.TLSVersion:
    name = section.get(key, default)
    if not isinstance(name, str) or name not in TLS_VERSIONS:
        raise ConfigError(path, f"tls_server_config.{key}", f"must be one of {', '.join(TLS_VERSIONS)}, got {name!r}")
    return TLS_VERSIONS[name]
