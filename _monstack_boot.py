"""What ``monstack-startup.pth`` runs when ``MONSTACK`` is set to a true value.

A module rather than code in the ``.pth`` line: site.py compiles a ``.pth`` line's source at
every start-up, and compiling this logic there cost as much as importing three of
monstack's modules; a module's bytecode is cached. Outside the ``monstack`` package on
purpose: what it guards against is importing that package failing (a broken install),
which costs one line on stderr instead of site.py's traceback.

**The start-up cache.** Importing a module through the import system costs ~0.35M
instructions before its own code runs (finders, module locks, reading and checking its
``.pyc``), and the boot imports about 17 of monstack's modules: a fifth of what
``MONSTACK=1`` adds to ``python -c pass``. So the first start-up records, in one file
beside this module's bytecode (``__pycache__/_monstack_boot.<cache tag>[.opt-N].modules``),
the code of each monstack module the boot imported (compiled with its
``from __future__ import annotations`` as a compiler flag, not a statement that imports
``__future__``), with its source's size and modification time, and in which order the
modules started and finished. A later start-up checks every recorded source (one
``stat`` each) and, when all match:

- the modules ``import monstack._startup`` imports (module-level imports only: the same
  set whatever the settings) are created as the import system creates them (the same
  spec, loader and attributes) and their recorded code runs, dependencies first;
- the modules the boot imports on demand (the backend's, which depend on the settings)
  are served from the recorded code by a meta path finder, only when imported.

It is used only where a regular import would find this very package (the standard
finders, no earlier ``monstack`` on ``sys.path``); anything else (a missing or stale file,
a shadowing package, an import hook, code that raises) takes the regular imports, and a
start-up that imported something not recorded writes the file again, as the import system
writes ``.pyc`` files (not under ``-B``/``PYTHONDONTWRITEBYTECODE``; never an error).

**Where the file cannot be written** (``-B``, ``PYTHONDONTWRITEBYTECODE``, a read-only
install: most container images) and there is no valid one, nothing is recorded (recording
compiles every module from its source: 5x the start-up of ``python -c pass``, for a file
that would never be written). The start-up modules (``_STARTED``/``_FINISHED``, which
tests/integration/test_boot.py checks against a recording) are then created as the
recorded ones are and run from their ``.pyc`` files, which the installer wrote (``pip``
compiles at install time), each checked against its source as the import system checks
it, without its finders and module locks; the modules the boot imports on demand
(``_ON_DEMAND``) get their spec without the path finder. Route "bytecode". ``python -m
monstack warm`` writes the file (and the native code's verdict) for an image build.
``MONSTACK_STARTUP_CACHE=0`` (or false/no/off) turns it off: the file is neither read nor
written, and the boot imports as the import system does.

PYTEST_DONT_REWRITE: pytest marks this module (a top-level module of the distribution that
provides the ``pytest11`` entry point) for assertion rewriting; under ``MONSTACK=1`` it is
imported before pytest starts, and this marker keeps pytest from warning about it.
"""

import sys

#: How the last boot imported monstack: "cache" (the start-up cache), "bytecode" (the
#: start-up modules run from their ``.pyc`` files: the cache can neither be used nor
#: written), "imports" (the import system), or "" (not booted in this process).
route = ""

#: The modules ``import monstack._startup`` imports, in the order they start and finish
#: (tests/integration/test_boot.py checks both against what a recording records), and
#: the packages among them.
_STARTED = ("monstack", "monstack._install", "monstack._capture", "monstack._stack", "monstack._env",
            "monstack._backend", "monstack._policy", "monstack._settings", "monstack._snapshot",
            "monstack._propagate", "monstack._points", "monstack._errors", "monstack._select", "monstack._startup")
_FINISHED = ("monstack._env", "monstack._stack", "monstack._backend", "monstack._settings", "monstack._policy",
             "monstack._snapshot", "monstack._capture", "monstack._points", "monstack._errors",
             "monstack._propagate", "monstack._select", "monstack._install", "monstack", "monstack._startup")
_PACKAGES = ("monstack", "monstack._points")
#: Plain modules (no package of the name) the boot may import on demand, depending on the
#: settings; the bytecode route gives them their spec without the path finder.
_ON_DEMAND = ("monstack._sysmon", "monstack._cdata", "monstack._native", "monstack._accel", "monstack._evalframe",
              "monstack._walk", "monstack._points.threading", "monstack._origin", "monstack._points.reports",
              "monstack._dumpsig")

_FORMAT = 2  # the cache file's layout (2: code compiled by _compile)
_FUTURE = b"\nfrom __future__ import annotations\n"
_OFF = ("", "0", "false", "no", "off")
#: The start-up cache's off switch (``_settings.STARTUP_CACHE_ENV``; this module runs before
#: monstack is imported, so it spells the name itself).
_SWITCH = "MONSTACK_STARTUP_CACHE"


def main() -> None:
    """Boot monstack once per process (site.py may process a venv's ``.pth`` files twice)."""
    import os

    if os.environ.get("MONSTACK", "").strip().lower() in _OFF or hasattr(sys, "_monstack_pth"):
        return
    sys._monstack_pth = 1  # type: ignore[attr-defined]
    try:
        _boot(os)
    except Exception as e:
        sys.stderr.write(
            "monstack: MONSTACK is set but monstack cannot start (%s: %s); running without it\n" % (type(e).__name__, e)
        )


def _boot(os) -> None:
    global route
    if os.environ.get(_SWITCH, "").strip().lower() in _OFF[1:]:  # unset or empty: on
        cache = None  # turned off: neither read nor written
    else:
        try:
            cache = _Cache.for_this_interpreter(os)
        except Exception:  # (an unusual import set-up): the import system alone
            cache = None
    if cache is None:  # the cache cannot apply here: the import system alone
        route = "imports"
        import monstack._startup as startup

        startup.boot()
        return
    sys.meta_path.insert(0, cache)
    try:
        startup = cache.run_recorded()
        route = "cache" if startup is not None else "imports"
        if startup is None and not cache.writable():  # nothing to record for
            cache.recording = False
            startup = cache.run_bytecode()
            route = "bytecode" if startup is not None else "imports"
        if startup is None:
            import monstack._startup as startup
        cache.eager = False  # from here on: what the boot imports on demand
        startup.boot()
    finally:
        if cache in sys.meta_path:
            sys.meta_path.remove(cache)
    cache.save()


def _read(os, path: str) -> bytes:
    """The bytes of file ``path``, read with ``os`` alone: ``open()`` makes a ``FileIO``
    and a ``BufferedReader`` and asks the kernel more (~15K instructions a file). (A
    file changed while read fails its checks, and is then read as the import system
    reads it.)"""
    fd = os.open(path, os.O_RDONLY)  # (not inheritable, as open() makes it: PEP 446)
    try:
        return os.read(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _compile(loader, name: str, origin: str):
    """A module's code as its loader compiles it, except that the statement
    ``from __future__ import annotations`` becomes the compiler flag it stands for: run, the
    statement imports ``__future__`` (~0.5M instructions, a module the program never asked
    for) to bind a name nothing reads. The line stays, blank: line numbers are unchanged."""
    data = loader.get_data(origin)
    if data.count(_FUTURE) != 1:
        return loader.get_code(name)
    # The flag the statement sets, as the compiler sees it (compiling does not import).
    flag = compile(_FUTURE, "", "exec", dont_inherit=True).co_flags ^ compile(b"", "", "exec", dont_inherit=True).co_flags
    return compile(data.replace(_FUTURE, b"\n\n"), origin, "exec", flags=flag, dont_inherit=True)


class _Cache:
    """The start-up cache: a meta path finder and loader for monstack's modules while the
    boot runs, which records what it loads through the import system."""

    def __init__(self, os, base: str, path: str) -> None:
        self.os = os
        self.base = base  # the directory holding this module and the package, with a separator
        self.path = path  # the cache file
        self.eager = True  # recording what ``import monstack._startup`` imports
        self.complete = True  # every monstack module imported was recorded
        self.changed = False  # something to write
        self.started: list = []  # the eager modules, in the order they started
        self.finished: list = []  # ... and finished (dependencies first)
        self.entries: dict = {}  # name -> (path below base, mtime_ns, size, code, eager,
        #   .pyc path below base or None, what its body imported: names, in the order they finished)
        self.loaders: dict = {}  # name -> the real loader, while its module loads
        self.done: list = []  # every monstack module this boot ran, in the order they finished
        self.recording = True  # False: the file cannot be written; serve specs, record nothing

    @classmethod
    def for_this_interpreter(cls, os):
        """The cache, or None where a regular import would not find this directory's package."""
        external = sys.modules["_frozen_importlib_external"]
        here = __file__
        base = here[: here.rfind(os.sep) + 1]
        # Where the import system would find the package: its own search, every finder
        # on sys.meta_path in order (an import hook ahead of the path finder decides).
        spec = sys.modules["_frozen_importlib"]._find_spec("monstack", None)
        if spec is None or spec.origin != base + "monstack" + os.sep + "__init__.py":
            return None
        if type(spec.loader) is not external.SourceFileLoader:
            return None
        try:
            path = external.cache_from_source(here)
        except (NotImplementedError, ValueError):  # no cache tag
            return None
        return cls(os, base, path[: path.rfind(".")] + ".modules")

    # -- reading and running --------------------------------------------------------------

    def run_recorded(self):
        """Run the recorded start-up modules; ``monstack._startup``, or None (not usable)."""
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except OSError:
            return None
        try:
            started, finished, entries = self._check(data)
        except Exception:  # unreadable, another layout, a source changed or gone
            return None
        if any(name in sys.modules for name in started):
            return None
        self.entries = entries
        self.started, self.finished = list(started), list(finished)
        modules: dict = {}
        try:
            for name in started:
                modules[name] = self._new(name)
            for name in started:
                sys.modules[name] = modules[name]
            for name in finished:
                self._run(name, modules[name])
        except Exception:  # the import system will say what is wrong, or do better
            for name, module in modules.items():
                if sys.modules.get(name) is module:
                    del sys.modules[name]
            self.entries, self.started, self.finished = {}, [], []
            return None
        return modules["monstack._startup"]

    def writable(self) -> bool:
        """Could ``save`` write the file? Not under ``-B``/``PYTHONDONTWRITEBYTECODE``, nor
        where its directory (or the nearest existing one above it) is not writable."""
        if sys.dont_write_bytecode:
            return False
        os = self.os
        path = self.path
        for _ in range(8):
            path = path[: path.rfind(os.sep)] or os.sep
            try:
                if os.path.isdir(path):
                    return os.access(path, os.W_OK)
            except Exception:
                return False
        return False

    def run_bytecode(self):
        """Run the start-up modules (``_STARTED``) from their ``.pyc`` files, each loaded
        by its ``SourceFileLoader`` as the import system loads it (the ``.pyc`` checked
        against the source, or the source compiled), without the finders and module
        locks; ``monstack._startup``, or None (then the import system)."""
        if any(name in sys.modules for name in _STARTED):
            return None
        import marshal

        self.marshal = marshal
        self.magic = sys.modules["_frozen_importlib_external"].MAGIC_NUMBER
        self.future = type(sys)("__future__")  # (see _exec)
        self.future.annotations = object()
        modules: dict = {}
        try:
            for name in _STARTED:
                modules[name] = sys.modules["_frozen_importlib"].module_from_spec(self._file_spec(name))
                modules[name].__spec__._initializing = False
            for name in _STARTED:
                sys.modules[name] = modules[name]
            for name in _FINISHED:
                module = modules[name]
                self._exec(self._bytecode(module.__spec__), module)
                sys.modules[name] = sys.modules.pop(name)
                parent, _, child = name.rpartition(".")
                if parent:
                    setattr(sys.modules[parent], child, module)
        except Exception:  # the import system will say what is wrong
            for name, module in modules.items():
                if sys.modules.get(name) is module:
                    del sys.modules[name]
            return None
        return modules["monstack._startup"]

    def _exec(self, code, module) -> None:
        """Run a module's ``.pyc`` code. Its ``from __future__ import annotations`` (a
        compiler directive; run, a statement that imports ``__future__``: ~0.9M
        instructions, a module the program never asked for) finds a stand-in in
        ``sys.modules`` while monstack's code runs, unless the real one is there; the
        name it binds is taken out again, so the modules are as the start-up cache
        leaves them (no ``__future__``, no ``annotations``)."""
        modules = sys.modules
        future = self.future
        lend = "__future__" not in modules
        if lend:
            modules["__future__"] = future
        try:
            exec(code, module.__dict__)
        finally:
            if lend and modules.get("__future__") is future:
                del modules["__future__"]
            if module.__dict__.get("annotations") is future.annotations:
                del module.__dict__["annotations"]

    def _bytecode(self, spec):
        """The code of ``spec``'s module from its ``.pyc`` file, checked as the import
        system checks it (magic number, timestamp-based, the source's mtime and size),
        read directly; anything else (no such file, another kind of ``.pyc``, a changed
        source) as its ``SourceFileLoader`` gets it (which may compile the source)."""
        origin = spec.origin
        try:
            st = self.os.stat(origin)
            data = _read(self.os, spec.cached)
            if (data[:4] == self.magic and data[4:8] == b"\0\0\0\0"
                    and int.from_bytes(data[8:12], "little") == int(st.st_mtime) & 0xFFFFFFFF
                    and int.from_bytes(data[12:16], "little") == st.st_size & 0xFFFFFFFF):
                code = self.marshal.loads(memoryview(data)[16:])
                sys.modules["_imp"]._fix_co_filename(code, origin)
                return code
        except Exception:  # (unreadable, another layout): as the import system would
            pass
        return spec.loader.get_code(spec.name)

    def _file_spec(self, name: str):
        """The spec the path finder makes for monstack module ``name`` (one of
        ``_STARTED`` or ``_ON_DEMAND``), from its name; ``cached`` as ``cache_from_source``
        gives it (spelt out in the usual case: no prefix, no ``-O``; else computed when read)."""
        external = sys.modules["_frozen_importlib_external"]
        sep = self.os.sep
        package = name in _PACKAGES
        origin = self.base + name.replace(".", sep) + (sep + "__init__.py" if package else ".py")
        spec = sys.modules["_frozen_importlib"].ModuleSpec(
            name, external.SourceFileLoader(name, origin), origin=origin, is_package=package
        )
        spec.has_location = True
        at = origin.rfind(sep)
        if package:
            spec.submodule_search_locations.append(origin[:at])
        tag = sys.implementation.cache_tag
        if tag is not None and sys.pycache_prefix is None and not sys.flags.optimize:
            spec.cached = origin[:at] + sep + "__pycache__" + sep + origin[at + 1 : -3] + "." + tag + ".pyc"
        return spec

    def _check(self, data: bytes):
        """The recorded lists and entries, if every recorded source is unchanged (raises if not)."""
        import marshal

        form, magic, started, finished, entries = marshal.loads(data)
        if form != _FORMAT or magic != sys.modules["_frozen_importlib_external"].MAGIC_NUMBER:
            raise ValueError("another layout or interpreter")
        if "monstack" not in finished or "monstack._startup" not in finished:
            raise ValueError("incomplete")
        stat = self.os.stat
        for rel, mtime, size, _code, _eager, _cached, _deps in entries.values():
            st = stat(self.base + rel)
            if st.st_mtime_ns != mtime or st.st_size != size:
                raise ValueError("changed: " + rel)
        return started, finished, entries

    def _spec(self, name: str):
        """The spec the path finder would make for a recorded module (made directly:
        ``spec_from_file_location`` and computing ``cached`` cost more than the rest)."""
        external = sys.modules["_frozen_importlib_external"]
        entry = self.entries[name]
        origin = self.base + entry[0]
        package = origin.endswith("__init__.py")
        spec = sys.modules["_frozen_importlib"].ModuleSpec(
            name, external.SourceFileLoader(name, origin), origin=origin, is_package=package
        )
        spec.has_location = True
        if entry[5] is not None:
            spec.cached = self.base + entry[5]
        if package:
            spec.submodule_search_locations.append(origin[: origin.rfind(self.os.sep)])
        return spec

    def _new(self, name: str):
        """A recorded module, created as the import system creates it (not yet run)."""
        spec = self._spec(name)
        module = sys.modules["_frozen_importlib"].module_from_spec(spec)
        spec._initializing = False  # as the import system leaves it
        return module

    def _run(self, name: str, module) -> None:
        """Run a recorded module (in ``sys.modules``) and finish as the import system
        does: moved to the end of ``sys.modules`` (its order: as finished), an
        attribute of its parent package."""
        exec(self._code(name), module.__dict__)
        sys.modules[name] = sys.modules.pop(name)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)

    def _code(self, name: str):
        entry = self.entries[name]
        code = entry[3]
        sys.modules["_imp"]._fix_co_filename(code, self.base + entry[0])  # as a .pyc load does
        return code

    # -- the finder and loader protocol (the modules imported while the boot runs) -------

    def find_spec(self, name: str, path=None, target=None):
        if name != "monstack" and not name.startswith("monstack."):
            return None
        if not self.recording:  # (the bytecode route) a known plain module: its spec
            if name in _ON_DEMAND and self.os.path.isfile(self.base + name.replace(".", self.os.sep) + ".py"):
                spec = self._file_spec(name)
                self.loaders[name] = spec.loader  # (exec_module loads its .pyc directly)
                spec.loader = self
                return spec
            return None
        try:
            return self._find_spec(name, path, target)
        except Exception:  # (never expected): the other finders, as without the cache
            self.complete = False
            return None

    def _find_spec(self, name: str, path, target):
        external = sys.modules["_frozen_importlib_external"]
        if name in self.entries and not self.eager:
            spec = self._spec(name)
        else:
            if name == "monstack":  # where the import system finds it (for_this_interpreter)
                origin = self.base + "monstack" + self.os.sep + "__init__.py"
                spec = external.spec_from_file_location(
                    name, origin, loader=external.SourceFileLoader(name, origin),
                    submodule_search_locations=[origin[: origin.rfind(self.os.sep)]],
                )
            else:
                spec = external.PathFinder.find_spec(name, path, target)
            if spec is None:  # (another finder's, or none): not recorded
                self.complete = False
                return None
            if type(spec.loader) is not external.SourceFileLoader:
                self.complete = False  # (sourceless, an extension...): not recorded
                return spec
            if self.eager:
                self.started.append(name)
        self.loaders[name] = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        name = module.__name__
        loader = self.loaders.pop(name)
        module.__loader__ = module.__spec__.loader = loader  # what the program sees
        if not self.recording:
            self._exec(self._bytecode(module.__spec__), module)
            return
        start = len(self.done)
        entry = self.entries.get(name)
        if entry is not None:
            # What this module's body imported when it was recorded, run first without the
            # import system (the body imports the same modules whatever the settings).
            for dep in entry[6]:
                if dep not in sys.modules and dep in self.entries:
                    self._run_direct(dep)
            exec(self._code(name), module.__dict__)
            self.done.append(name)
            return
        origin = module.__spec__.origin
        st = self.os.stat(origin)  # before reading the code: an edit in between shows next time
        code = _compile(loader, name, origin)
        exec(code, module.__dict__)
        if not origin.startswith(self.base):
            self.complete = False
            return
        cached = module.__spec__.cached
        cached = cached[len(self.base) :] if cached and cached.startswith(self.base) else None
        deps = () if self.eager else tuple(self.done[start:])
        self.entries[name] = (origin[len(self.base) :], st.st_mtime_ns, st.st_size, code, self.eager, cached, deps)
        if self.eager:
            self.finished.append(name)
        self.done.append(name)
        self.changed = True

    def _run_direct(self, name: str) -> None:
        """Create and run a recorded module as the import system would, without it."""
        module = sys.modules[name] = self._new(name)
        try:
            self._run(name, module)
        except BaseException:
            if sys.modules.get(name) is module:
                del sys.modules[name]
            raise
        self.done.append(name)

    # -- writing --------------------------------------------------------------------------

    def save(self) -> None:
        """Write the cache if this boot recorded something new; never raises."""
        if not self.recording or not self.changed or not self.complete or sys.dont_write_bytecode:
            return
        if "monstack" not in self.finished or "monstack._startup" not in self.finished:
            return
        os = self.os
        tmp = "%s.%d.tmp" % (self.path, os.getpid())
        try:
            import marshal

            external = sys.modules["_frozen_importlib_external"]
            data = marshal.dumps(
                (_FORMAT, external.MAGIC_NUMBER, tuple(self.started), tuple(self.finished), self.entries)
            )
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path)
        except Exception:  # a read-only directory, a full disk: the next boot imports again
            try:
                os.unlink(tmp)
            except OSError:
                pass
