"""Build hook: put ``monstack-startup.pth`` at the top of site-packages.

A ``.pth`` file only works in a site directory itself, which package data cannot reach, so
``build_py`` copies it to the root of the build tree (a regular wheel installs that root
into site-packages) and, for an editable install (PEP 660), into the root of the editable
wheel that ``editable_wheel`` assembles (its ``install`` command points there).
Referenced from ``[tool.setuptools] cmdclass`` in pyproject.toml; not shipped.
"""

from __future__ import annotations

import os

from setuptools.command.build_py import build_py as _build_py

PTH_NAME = "monstack-startup.pth"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), PTH_NAME)


class build_py(_build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            # editable_wheel sets install_lib to the unpacked wheel it zips up afterwards.
            target_dir = self.get_finalized_command("install").install_lib
        else:
            target_dir = self.build_lib
        self.mkpath(target_dir)
        self.copy_file(_SOURCE, os.path.join(target_dir, PTH_NAME), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:  # type: ignore[override]
        outputs = list(super().get_outputs(include_bytecode))
        if not getattr(self, "editable_mode", False):
            outputs.append(os.path.join(self.build_lib, PTH_NAME))
        return outputs
