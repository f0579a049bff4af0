"""Randomized soak of the scheduler (scripts/soak.py), bounded for CI: about 20 s of random
valid and invalid operations on a tiny llama, then a drain. The soak itself raises on the first
broken invariant (an undocumented exception, a wrong error, a failed call that changed the
state, a completed request that differs from its solo run); here the figures are checked too.

Longer on demand: ``NEURONFX_SOAK_OPS=10000 .venv/bin/python scripts/soak.py``.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "soak.py"
CI_SECONDS = float(os.environ.get("NEURONFX_SOAK_CI_SECONDS", "20"))
CI_MAX_OPS = 5000


def load_soak():
    spec = importlib.util.spec_from_file_location("neuronfx_soak", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_soak_random_operations():
    soak = load_soak()
    figures = soak.run(ops=CI_MAX_OPS, seconds=CI_SECONDS, seed=int(os.environ.get("NEURONFX_SOAK_SEED", "0")))
    assert figures["operations"] >= 300, figures
    by_op = figures["by_operation"]
    assert set(by_op) == set(soak.OPERATIONS), by_op  # every kind of operation ran
    errors = figures["errors_by_kind"]
    assert {"SlotError", "StateConsumedError", "StateMismatchError", "SamplingParamsError"} <= set(errors), errors
    reasons = figures["finish_reasons"]
    assert reasons.get("length", 0) >= 20 and reasons.get("stop", 0) >= 1, reasons
    growth = figures["rss_mib_end"] - figures["rss_mib_after_warmup"]
    assert growth <= soak.RSS_TOLERANCE_MIB, figures
