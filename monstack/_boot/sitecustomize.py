"""monstack's sitecustomize route: for interpreters that do not process ``.pth`` files
(monstack installed with ``pip install --target``, zip apps, some embedders) and for child
processes of ``python -m monstack run`` when monstack is not installed in site-packages.

Put this directory on ``PYTHONPATH`` and set ``MONSTACK=1``. It starts monstack (if
``monstack`` cannot be imported, the directory holding this copy of the package is tried),
then runs the ``sitecustomize`` module it shadows, if there is one, so an existing
sitecustomize keeps working. It never breaks start-up.
"""

import os
import sys


def _monstack_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    value = os.environ.get("MONSTACK", "").strip().lower()
    if value not in ("", "0", "false", "no", "off"):
        try:
            try:
                import monstack._startup as startup
            except ImportError:
                package_parent = os.path.dirname(os.path.dirname(here))
                if package_parent not in sys.path:
                    sys.path.append(package_parent)
                import monstack._startup as startup
            startup.boot()
        except Exception as exc:
            sys.stderr.write(
                "monstack: MONSTACK is set but monstack cannot start (%s: %s); running without it\n"
                % (type(exc).__name__, exc)
            )
    # Run the sitecustomize this file shadows, as site.py would have.
    try:
        import importlib.machinery
        import importlib.util

        path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            sys.modules["sitecustomize"] = module
            spec.loader.exec_module(module)
    except Exception as exc:
        sys.stderr.write("Error in sitecustomize; set PYTHONVERBOSE for traceback:\n%s: %s\n" % (type(exc).__name__, exc))


_monstack_sitecustomize()
del _monstack_sitecustomize
