"""What the fork server of ``neuronfx.launch`` imports when it starts: where
``$NEURONFX_FORK_SERVER`` is set (JSON ``{"sys_path": [...], "modules": [...]}``, only in the
server's environment: ``distributed._start_fork_server`` sets it while the server starts), it
takes the launching process's import path and imports the modules named, so that the ranks
forked from the server start with torch, neuronfx and the launched function's module imported.
Python 3.11's server ignores the import path it is given, and any import error but ImportError
would end it. Elsewhere (``distributed.py`` imports it for its names) importing it does nothing."""

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
