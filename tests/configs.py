"""Print the test configurations the suite runs in on this interpreter, for tests/run-all.sh
(which runs it with each venv's python and sets ``MONSTACK_TEST_CONFIG`` to each word).

Where the native sys.monitoring callbacks can run (CPython 3.12-3.15 on a platform with
their machine code), the suite runs twice: ``native`` (with them) and ``python`` (with the
pure-Python callbacks); elsewhere once, ``default``. tests/conftest.py reads the choice.

    .venvs/py3.12/bin/python tests/configs.py    # -> native python
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from monstack import _env  # noqa: E402


def configs() -> list[str]:
    if _env.HAS_SYSMON:
        from monstack import _accel

        if _accel.unavailable() is None:
            return ["native", "python"]
    return ["default"]


if __name__ == "__main__":
    print(" ".join(configs()))
