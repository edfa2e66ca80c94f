"""TLS and basic auth for the exporter's own endpoint, from a web configuration file in the
format of Prometheus' exporter-toolkit (`--web.config.file`), so the same file serves the node
exporter and this one."""

from __future__ import annotations

import base64
import hashlib
import ssl
import threading
from dataclasses import dataclass, field
from typing import Any

import yaml

from .config import ConfigError

CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "RequestClientCert": ssl.CERT_OPTIONAL,
    "RequireAnyClientCert": ssl.CERT_REQUIRED,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
TLS_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
                "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
_TLS_KEYS = {"cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version", "max_version"}


@dataclass
class WebConfig:
    tls: ssl.SSLContext | None = None
    users: dict[str, bytes] = field(default_factory=dict)  # user -> bcrypt hash
    # bcrypt is slow on purpose; remember credentials that passed so each scrape does not pay for it.
    _verified: set[bytes] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def authorized(self, header: str | None) -> bool:
        if not self.users:
            return True
        if not header or not header.startswith("Basic "):
            return False
        try:
            user, _, password = base64.b64decode(header[6:], validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        hashed = self.users.get(user)
        if hashed is None:
            return False
        token = hashlib.sha256(user.encode() + b"\0" + password.encode() + b"\0" + hashed).digest()
        with self._lock:
            if token in self._verified:
                return True
        import bcrypt

        if not bcrypt.checkpw(password.encode(), hashed):
            return False
        with self._lock:
            if len(self._verified) > 1024:
                self._verified.clear()
            self._verified.add(token)
        return True


def load(path: str) -> WebConfig:
    """Raises ConfigError naming the file and key."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle) or {}
    except OSError as err:
        raise ConfigError(path, "(file)", err.strerror or str(err)) from None
    except yaml.YAMLError as err:
        raise ConfigError(path, "(file)", f"invalid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(path, "(top level)", "must be a mapping")
    for key in data:
        if key not in ("tls_server_config", "basic_auth_users", "http_server_config"):
            raise ConfigError(path, str(key), "unknown key")
    web = WebConfig()
    if data.get("tls_server_config"):
        web.tls = _tls_context(path, data["tls_server_config"])
    users = data.get("basic_auth_users") or {}
    if not isinstance(users, dict):
        raise ConfigError(path, "basic_auth_users", "must be a mapping of user names to bcrypt hashes")
    for user, hashed in users.items():
        if not isinstance(hashed, str) or not hashed.startswith(("$2a$", "$2b$", "$2y$")):
            raise ConfigError(path, f"basic_auth_users.{user}", "must be a bcrypt hash ($2y$...)")
        web.users[str(user)] = hashed.encode()
    return web


def _tls_context(path: str, section: Any) -> ssl.SSLContext:
    if not isinstance(section, dict):
        raise ConfigError(path, "tls_server_config", "must be a mapping")
    for key in section:
        if key not in _TLS_KEYS:
            raise ConfigError(path, f"tls_server_config.{key}", "unknown key")
    for key in ("cert_file", "key_file"):
        if not section.get(key):
            raise ConfigError(path, f"tls_server_config.{key}", "is required")
    auth_type = section.get("client_auth_type", "NoClientCert")
    if auth_type not in CLIENT_AUTH:
        raise ConfigError(path, "tls_server_config.client_auth_type", f"must be one of {', '.join(CLIENT_AUTH)}")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = TLS_VERSIONS.get(section.get("min_version", "TLS12"), ssl.TLSVersion.TLSv1_2)
    try:
        context.load_cert_chain(section["cert_file"], section["key_file"])
    except (OSError, ssl.SSLError) as err:
        raise ConfigError(path, "tls_server_config.cert_file", f"cannot load certificate and key: {err}") from None
    context.verify_mode = CLIENT_AUTH[auth_type]
    if auth_type in ("VerifyClientCertIfGiven", "RequireAndVerifyClientCert") or section.get("client_ca_file"):
        if not section.get("client_ca_file"):
            raise ConfigError(path, "tls_server_config.client_ca_file", f"is required with {auth_type}")
        try:
            context.load_verify_locations(section["client_ca_file"])
        except (OSError, ssl.SSLError) as err:
            raise ConfigError(path, "tls_server_config.client_ca_file", f"cannot load: {err}") from None
    return context
