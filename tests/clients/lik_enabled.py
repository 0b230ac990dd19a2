"""pytest plugin: a client library's own test suite with lik's integration enabled.

    LIK_CLIENT=pylate|colpali|sentence_transformers pytest -p lik_enabled ...

(with this folder on PYTHONPATH). The integration is enabled in pytest_configure, before
any of the suite's test modules or conftest files below the root import the library's
modules, so every copy the library's own modules hold is the routed twin. At the end it
writes how often the suite's calls reached a routed twin, and how often lik scored one,
to the JSON file named by LIK_CLIENT_REPORT (run_client_suites.py reads it).
"""

from __future__ import annotations

import importlib
import json
import os

_COUNTS = {"reached_a_twin": 0, "lik_scored": 0}


def _count_twins() -> None:
    from lik.integrations import Integration

    routing = Integration.routing

    def counted(self):
        _COUNTS["reached_a_twin"] += 1
        return routing(self)

    Integration.routing = counted  # read by each twin made from now on


def _count_lik() -> None:
    from lik import runtime
    from lik.runtime import api, variants

    for module, name in ((runtime, "maxsim"), (runtime, "maxsim_pairs"),
                         (runtime, "maxsim_varlen"), (runtime, "score_pairs_packed"),
                         (variants, "maxsim_smooth"), (variants, "maxsim_weighted"),
                         (api, "maxsim_masked_as_zero")):  # fmt: skip
        real = getattr(module, name)

        def counted(*args, _real=real, **kwargs):
            out = _real(*args, **kwargs)
            _COUNTS["lik_scored"] += 1
            return out

        setattr(module, name, counted)


def pytest_configure(config):
    client = os.environ["LIK_CLIENT"]
    _count_twins()
    _count_lik()
    importlib.import_module(f"lik.integrations.{client}").enable()


def pytest_unconfigure(config):
    report = os.environ.get("LIK_CLIENT_REPORT")
    if report:
        with open(report, "w") as out:
            json.dump(_COUNTS, out)
