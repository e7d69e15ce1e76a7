"""``python -m monstack run [options] (script.py | -m module) [args...]``.

The program runs in this process, as ``python script.py`` / ``python -m module`` would run
it (a new ``__main__`` module with the same ``__file__``, ``__spec__`` and globals, the same
``sys.argv`` and ``sys.path[0]``: tests/unit/test_run.py compares them with plain python), with
monstack installed first. So its exit
code and the signals it receives need no forwarding: an uncaught exception exits 1 after
the usual traceback, ``SystemExit`` and ``KeyboardInterrupt`` behave as under plain
``python``. The settings go into the environment (``MONSTACK=1`` and ``MONSTACK_*``), so
child Python processes (``subprocess``, ``multiprocessing`` with spawn) start monstack
too: through the ``.pth`` hook when monstack is installed in site-packages, otherwise
through the sitecustomize route put on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import builtins
import os
import runpy
import sys
from types import ModuleType, TracebackType
from typing import Any, NoReturn, Optional, Sequence

from . import _env, _settings, _startup

PROG = "python -m monstack run"
USAGE = f"{PROG} [options] (script.py | -m module) [args ...]"
BOOT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_boot")
PTH_NAME = "monstack-startup.pth"


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line (``PROG: error: ...``, exit
    code 2), without the usage block: ``--help`` has it."""

    def error(self, message: str) -> "NoReturn":  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG,
        usage=USAGE,
        description="Run a Python program with monstack on (child Python processes too).",
        epilog="Options after the script or module name go to the program. "
        "Each option sets the MONSTACK_* variable of the same name for this process and its children.",
    )
    for setting in _settings.SETTINGS:
        if setting.flag is None:
            continue
        parser.add_argument(
            setting.flag,
            dest=setting.var,
            metavar="VALUE",
            action="append" if setting.repeat else "store",
            help=f"{setting.doc} Valid: {setting.valid}. Sets {setting.var}." + (" Repeatable." if setting.repeat else ""),
        )
    parser.add_argument("-m", dest="module", metavar="MODULE", help="run a module as a script (like python -m)")
    return parser


def _option_flags(parser: argparse.ArgumentParser) -> dict[str, bool]:
    """Option string -> takes a value?"""
    flags: dict[str, bool] = {}
    for action in parser._actions:
        for opt in action.option_strings:
            flags[opt] = action.nargs != 0
    return flags


def split_argv(argv: Sequence[str], parser: Optional[argparse.ArgumentParser] = None) -> tuple[list[str], Optional[str], Optional[str], list[str]]:
    """``argv`` -> (monstack options, script, module, program arguments).

    monstack's options end at the first word that is not one of them: the script, ``-m
    MODULE``, or ``--``. Everything after belongs to the program, untouched.
    """
    flags = _option_flags(parser or _parser())
    argv = list(argv)
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            if i + 1 >= len(argv):
                return argv[:i], None, None, []
            return argv[:i], argv[i + 1], None, argv[i + 2 :]
        if word == "-m":
            if i + 1 >= len(argv):
                return argv[: i + 1], None, None, []  # argparse reports the missing MODULE
            return argv[:i], None, argv[i + 1], argv[i + 2 :]
        if word.startswith("-m") and len(word) > 2 and not word.startswith("--"):
            return argv[:i], None, word[2:], argv[i + 1 :]
        if word.startswith("-") and word != "-":
            name = word.split("=", 1)[0]
            if flags.get(name) and "=" not in word:
                i += 2
            else:
                i += 1  # a flag without a value, or unknown (argparse reports it)
            continue
        return argv[:i], word, None, argv[i + 1 :]
    return argv, None, None, []


def configure(options: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, str]:
    """Validate the options with the same rules as the variables; -> variable: text."""
    values: dict[str, str] = {}
    parsed: dict[str, Any] = {}
    for setting in _settings.SETTINGS:
        given = getattr(options, setting.var, None) if setting.flag else None
        if given is None:
            continue
        text = ",".join(given) if isinstance(given, list) else given
        try:
            parsed[setting.var] = setting.parse(text)
        except _settings.BadValue as exc:
            parser.error(f"{setting.flag} {text!r}: valid values: {exc.valid}")
        values[setting.var] = text
    why = _cannot_run(parsed)
    if why is not None:
        parser.error(why)
    return values


def _cannot_run(parsed: dict[str, Any]) -> Optional[str]:
    """Why valid options cannot work in this process (what install() would refuse or
    warn about once the program runs), or None: said up front, as a usage error."""
    backend = parsed.get("MONSTACK_BACKEND", "auto")
    if backend != "auto":
        from . import _select

        why_not = _select.reasons().get(backend)
        if why_not is not None:
            return f"--backend {backend!r} cannot run here: {why_not}"
    if parsed.get("MONSTACK_ACCELERATOR") is True:
        if backend == "walk":
            return "--accelerator on conflicts with --backend walk: the walk backend runs no native code"
    signal_name = parsed.get(_settings.DUMP_SIGNAL_ENV)
    if signal_name is not None:
        from . import _dumpsig

        why = _dumpsig.refusal(signal_name)
        if why is not None:
            return f"--dump-signal: {why}"
    return None


def pth_active() -> bool:
    """True when a fresh interpreter would run our ``.pth`` line and import this monstack."""
    try:
        import site

        dirs = list(site.getsitepackages())
        if site.ENABLE_USER_SITE:
            dirs.append(site.getusersitepackages())
    except Exception:
        return False
    package_parent = os.path.normcase(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for d in dirs:
        if os.path.isfile(os.path.join(d, PTH_NAME)) and os.path.normcase(os.path.abspath(d)) == package_parent:
            return True
    return False


def child_environment(values: dict[str, str], environ: Optional[dict] = None) -> None:
    """Set up ``environ`` (default ``os.environ``) so child Python processes run monstack."""
    env = os.environ if environ is None else environ
    _settings.to_environ(values, env)
    if not pth_active():
        parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if BOOT_DIR not in parts:
            env["PYTHONPATH"] = os.pathsep.join([BOOT_DIR] + parts)


def _fresh_main() -> ModuleType:
    """A new ``__main__`` module as the interpreter makes one (``__name__``, ``__doc__``,
    ``__package__``, ``__loader__``, ``__spec__``, ``__annotations__`` where this version
    has it, ``__builtins__``), not yet in ``sys.modules``. The one running now is this
    runner's (``python -m monstack``): the program must not see its globals."""
    main = ModuleType("__main__")
    current = sys.modules.get("__main__")
    if current is not None and "__annotations__" in vars(current):
        main.__annotations__ = {}
    main.__dict__["__builtins__"] = builtins
    return main


def _abspath(path: str) -> str:
    """The script's path as the interpreter makes ``__file__`` (the current directory
    joined in front, not normalised: ``./a/../b.py`` stays as it is)."""
    return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)


def _run_file(script: str) -> None:
    """``python script`` in this process: ``sys.path[0]`` the script's real directory (a
    directory or zip file: itself), a new ``__main__`` whose ``__file__`` is absolute,
    ``__spec__`` None, ``__loader__`` a file loader, the code compiled with the absolute
    name (tracebacks show it), ``__file__`` (and ``__cached__`` before 3.15) removed after
    it ran."""
    import importlib.machinery as machinery

    filename = _abspath(script)
    if os.path.isdir(script) or _is_zip(script):
        # As python does: the path first on sys.path, then its __main__ module as -m runs one.
        _set_path0(filename)
        try:
            _name, spec, code = runpy._get_main_module_details()  # type: ignore[attr-defined]
        except Exception as exc:
            raise _NotFound(str(exc)) from None
        _run_spec(code, spec)
        return
    safe_path = getattr(sys.flags, "safe_path", False)
    if not safe_path:
        _set_path0(os.path.dirname(os.path.realpath(script)))
    main = _fresh_main()
    if filename.endswith(".pyc"):
        loader: Any = machinery.SourcelessFileLoader("__main__", filename)
        code = loader.get_code("__main__")
    else:
        loader = machinery.SourceFileLoader("__main__", filename)
        code = compile(loader.get_data(filename), filename, "exec", dont_inherit=True)
    namespace = main.__dict__
    namespace["__loader__"] = loader
    namespace["__file__"] = filename
    if _env.SETS_CACHED:  # (3.15 no longer sets it)
        namespace["__cached__"] = None
    sys.modules["__main__"] = main
    try:
        exec(code, namespace)
    finally:
        namespace.pop("__file__", None)
        namespace.pop("__cached__", None)


def _run_module(module: str, args: list[str]) -> None:
    """``python -m module``: ``sys.argv[0]`` the module's file, ``sys.path[0]`` the current
    directory (``-m monstack`` set it already), a new ``__main__`` with the module's spec."""
    sys.argv = ["-m"] + list(args)
    try:
        _name, spec, code = runpy._get_module_details(module, runpy._Error)  # type: ignore[attr-defined]
    except runpy._Error as exc:  # type: ignore[attr-defined]
        raise _NotFound(str(exc)) from None
    sys.argv[0] = spec.origin
    _run_spec(code, spec)


def _run_spec(code: Any, spec: Any) -> None:
    """Run a module's code as ``__main__`` in a new module, as ``runpy`` runs ``-m``."""
    main = _fresh_main()
    sys.modules["__main__"] = main
    runpy._run_code(code, main.__dict__, None, "__main__", spec)  # type: ignore[attr-defined]


class _NotFound(Exception):
    """The module or a directory's ``__main__`` cannot be found (``python -m`` says why)."""


def _set_path0(path: str) -> None:
    """Replace the ``sys.path[0]`` ``-m monstack`` put first (under ``-P`` it put none)."""
    if getattr(sys.flags, "safe_path", False) or not sys.path:
        sys.path.insert(0, path)
    else:
        sys.path[0] = path


def _is_zip(path: str) -> bool:
    try:
        import zipfile

        return zipfile.is_zipfile(path)
    except Exception:
        return False


def _strip_runner(tb: Optional[TracebackType]) -> Optional[TracebackType]:
    """Drop the frames of this module and runpy from the front of a traceback."""
    here = os.path.normcase(os.path.abspath(__file__))
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_globals.get("__name__") != "runpy" and os.path.normcase(os.path.abspath(frame.f_code.co_filename)) != here:
            break  # runpy's code may be frozen ("<frozen runpy>"): recognised by module name
        tb = tb.tb_next
    return tb


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: ``argv`` is everything after ``run``. Returns the exit code (the
    program's own ``sys.exit`` propagates as ``SystemExit``)."""
    parser = _parser()
    if argv is None:
        argv = sys.argv[1:]
    own, script, module, program_args = split_argv(argv, parser)
    options = parser.parse_args(own)
    if options.module is not None and module is None:
        module = options.module
    if script is None and module is None:
        parser.error("give a script or -m MODULE to run")
    values = configure(options, parser)
    if script is not None and not os.path.exists(script):
        sys.stderr.write(f"{PROG}: can't open file {script!r}: no such file\n")
        return 2
    child_environment(values)

    # The program's settings are now in os.environ: start monstack from them, as a child
    # process would (bad inherited MONSTACK_* values warn and fall back to defaults).
    _startup.boot(again=True)

    try:
        if module is not None:
            _run_module(module, program_args)
        else:
            assert script is not None
            sys.argv = [script] + list(program_args)
            _run_file(script)
    except _NotFound as exc:  # as "python -m" / "python dir" say it
        sys.stderr.write(f"{PROG}: {exc}\n")
        return 1
    except (SystemExit, KeyboardInterrupt):
        raise  # exit code / death by SIGINT exactly as under plain python
    except BaseException as exc:
        tb = _strip_runner(exc.__traceback__)
        try:
            exc.with_traceback(tb)  # the hook prints exc.__traceback__, not its tb argument
        except Exception:
            pass
        try:
            sys.excepthook(type(exc), exc, tb)
        except Exception:
            import traceback

            traceback.print_exception(type(exc), exc, tb)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover - ``python -m monstack._run``
    sys.exit(main())
