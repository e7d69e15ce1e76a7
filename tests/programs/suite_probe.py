"""A pytest plugin for tests/integration/test_trio_suite.py (``-p suite_probe``): at the end of the
session it writes which backend monstack has and which propagation points are on to the
file named by ``SUITE_PROBE``, so the test knows monstack was on for the whole run."""

import json
import os


def pytest_sessionfinish(session, exitstatus):
    import monstack
    from monstack import _points

    with open(os.environ["SUITE_PROBE"], "w") as f:
        json.dump({"backend": monstack.active_backend(), "points": sorted(_points.ON)}, f)
