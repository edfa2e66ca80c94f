"""The `kvcache-exporter` command, one module per command: `serve` (no subcommand: the exporter, or
`--demo`), `check-config`, `kv-math`, `assets` and `top`. Only the module of the command that runs is imported."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "check-config":
        from . import check_config

        return check_config.main(rest)
    if command == "kv-math":
        from . import kv_math

        return kv_math.main(rest)
    if command == "assets":
        from . import assets

        return assets.main(rest)
    if command == "top":
        from . import top

        return top.main(rest)
    from . import serve

    return serve.main(argv)
