"""What the fork server of ``neuronfx.launch`` imports when it starts, and nothing else imports:
it takes the launching process's import path and imports the modules named in
``$NEURONFX_FORK_SERVER`` (JSON ``{"sys_path": [...], "modules": [...]}``, set by
``distributed._start_fork_server`` while the server starts), so that the ranks forked from it
start with torch, neuronfx and the launched function's module imported. Python 3.11's server
ignores the import path it is given, and any import error but ImportError would end it."""

from __future__ import annotations

import importlib
import json
import os
import sys

ENV_VAR = "NEURONFX_FORK_SERVER"


def preload(spec: str) -> list[str]:
    """Apply the import path of ``spec`` (JSON, see the module docstring) and import its modules;
    the names of those that failed (each rank imports them again and fails there, as a spawned
    rank would, instead of the server)."""
    data = json.loads(spec)
    sys.path[:] = data["sys_path"]
    failed = []
    for name in data["modules"]:
        try:
            importlib.import_module(name)
        except Exception:  # the rank imports it again and reports it; the server must live
            failed.append(name)
    return failed


if ENV_VAR in os.environ:
    preload(os.environ[ENV_VAR])
