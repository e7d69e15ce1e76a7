"""Every ``MONSTACK_*`` environment variable: its name, accepted values, default, and parser.

The bottom layer (with ``_env``): start-up, the runner, ``install()``'s defaults and the
colour decision all read the environment through here. Every variable is one row of
:data:`SETTINGS`; adding a variable (and the ``install()`` keyword it feeds) is adding a
row. Bad values never raise here at start-up: they become messages naming the variable
and its valid values.

Imports only ``os``: this runs at interpreter start-up under ``MONSTACK=1``.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Mapping, MutableMapping, Optional

#: Backends ``install(backend=...)`` and ``MONSTACK_BACKEND`` accept.
BACKEND_CHOICES: tuple[str, ...] = ("auto", "monitoring", "evalframe", "walk")
#: ``install(track=...)`` / ``MONSTACK_TRACK``: your code only, or everything.
TRACK_CHOICES: tuple[str, ...] = ("user", "all")
#: Every propagation point ``install(propagate=...)`` knows (patched by ``_propagate``).
PROPAGATION_POINTS: tuple[str, ...] = (
    "threading",
    "thread_pool",
    "process_pool",
    "asyncio_tasks",
    "asyncio_executor",
    "process",
    "mp_pool",
    "start_new_thread",
    "trio",
    "celery",
    "dask",
    "rq",
    "sentry",
)

#: The variable that selects a backend (``install(backend=None)`` reads it).
BACKEND_ENV = "MONSTACK_BACKEND"
#: The variable that turns the native callbacks off (``install(accelerator=None)`` reads it).
ACCELERATOR_ENV = "MONSTACK_ACCELERATOR"
#: The variable that chooses colour in monstack's reports.
COLOR_ENV = "MONSTACK_COLOR"
#: The variable naming the signal that makes a process dump every thread's stack.
DUMP_SIGNAL_ENV = "MONSTACK_DUMP_SIGNAL"
#: The variable that turns the start-up cache off (read by ``_monstack_boot``, which cannot
#: import this module first: it spells the name itself, and a test compares the two).
STARTUP_CACHE_ENV = "MONSTACK_STARTUP_CACHE"

#: ``MONSTACK`` values that turn monstack on (case-insensitive, surrounding blanks ignored).
TRUE_VALUES: tuple[str, ...] = ("1", "true", "yes", "on")
#: ``MONSTACK`` values that leave it off (unset is off too).
FALSE_VALUES: tuple[str, ...] = ("", "0", "false", "no", "off")

ENABLE_VAR = "MONSTACK"

#: Colour preferences (``MONSTACK_COLOR``): value -> ``color`` argument of the formatters.
COLOR_VALUES: dict[str, Optional[bool]] = {
    "auto": None,
    "always": True,
    "1": True,
    "yes": True,
    "true": True,
    "on": True,
    "never": False,
    "0": False,
    "no": False,
    "false": False,
    "off": False,
}


class BadValue(ValueError):
    """A variable's value is not one of the accepted ones; ``valid`` says which are."""

    def __init__(self, valid: str) -> None:
        super().__init__(valid)
        self.valid = valid


# -- parsers: text -> value, or BadValue(valid values) ------------------------------------


def _words(text: str) -> list[str]:
    """``os.pathsep``- or comma-separated entries, blanks dropped."""
    out: list[str] = []
    for part in text.replace(os.pathsep, ",").split(","):
        part = part.strip()
        if part:
            out.append(part)
    return out


def _parse_backend(text: str) -> str:
    value = text.strip().lower()
    if value not in BACKEND_CHOICES:
        raise BadValue(", ".join(BACKEND_CHOICES))
    return value


def _parse_track(text: str) -> str:
    value = text.strip().lower()
    if value not in TRACK_CHOICES:
        raise BadValue(", ".join(TRACK_CHOICES))
    return value


def _parse_rules(text: str) -> tuple[str, ...]:
    words = tuple(_words(text))
    if not words and text.strip():  # ",,": a list that names nothing is a mistake
        raise BadValue("module names or path prefixes, separated by commas or os.pathsep")
    return words


def _parse_chain_limit(text: str) -> int:
    valid = "a whole number >= 1"
    try:
        value = int(text.strip())
    except ValueError:
        raise BadValue(valid) from None
    if value < 1:
        raise BadValue(valid)
    return value


def _parse_propagate(text: str) -> Any:
    valid = "1/true/yes/on/all (every point), 0/false/no/off/none, or a comma-separated list of: " + ", ".join(
        PROPAGATION_POINTS
    )
    value = text.strip().lower()
    if value in TRUE_VALUES or value == "all":
        return True
    if value in FALSE_VALUES or value == "none":
        return False
    names = _words(value)
    if not names or any(n not in PROPAGATION_POINTS for n in names):
        raise BadValue(valid)
    return tuple(names)


def _parse_color(text: str) -> Optional[bool]:
    value = text.strip().lower()
    if value not in COLOR_VALUES:
        raise BadValue("auto, always (or 1/yes/true/on), never (or 0/no/false/off)")
    return COLOR_VALUES[value]


def _parse_accelerator(text: str) -> Optional[bool]:
    value = text.strip().lower()
    if value == "auto":
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise BadValue("auto, 1/true/yes/on (require the native callbacks), 0/false/no/off")


def _parse_switch(text: str) -> bool:
    value = text.strip().lower()
    if value in TRUE_VALUES:
        return True
    if value in FALSE_VALUES:
        return False
    raise BadValue("1/true/yes/on, 0/false/no/off")


def _parse_signal(text: str) -> str:
    """A signal name (``USR1``, ``SIGUSR1``, any case) -> ``"SIGUSR1"``. Whether this
    platform has it, and whether it may be used, is decided where the handler is installed."""
    value = text.strip().upper()
    if not value.startswith("SIG"):
        value = "SIG" + value
    if len(value) < 4 or not value[3:].isalnum() or not value[3].isalpha():
        raise BadValue("a signal name such as USR1, USR2 or QUIT (with or without SIG)")
    return value


class Setting:
    """One ``MONSTACK_*`` variable: how to read it and which ``install()`` keyword it feeds.

    (A plain class: a dataclass would import ``inspect``, a NamedTuple ``typing``, at
    start-up.)
    """

    __slots__ = ("var", "option", "parse", "valid", "default", "doc", "flag", "repeat")

    def __init__(
        self,
        var: str,
        option: Optional[str],
        parse: Callable[[str], Any],
        valid: str,
        default: str,
        doc: str,
        flag: Optional[str] = None,
        repeat: bool = False,
    ) -> None:
        self.var = var
        #: The ``install()`` keyword it sets, or None for settings read elsewhere (colour).
        self.option = option
        self.parse = parse
        #: The accepted values, as the warning and the README say them.
        self.valid = valid
        #: What applies when the variable is unset or bad.
        self.default = default
        self.doc = doc
        #: ``python -m monstack run`` option that sets this variable (None: no option).
        self.flag = flag
        #: The flag may repeat; its values are joined with commas.
        self.repeat = repeat

    def __repr__(self) -> str:
        return f"Setting({self.var!r}, option={self.option!r}, flag={self.flag!r})"


#: Every variable monstack reads at start-up, in the order the README lists them.
SETTINGS: tuple[Setting, ...] = (
    Setting(
        "MONSTACK_BACKEND", "backend", _parse_backend, "auto, monitoring, evalframe, walk", "auto",
        "Which backend keeps the stacks (auto: the best one this interpreter has).", "--backend",
    ),
    Setting(
        "MONSTACK_TRACK", "track", _parse_track, "user, all", "user",
        "Which code is tracked: your code (not the standard library or site-packages), or all.",
        "--track",
    ),
    Setting(
        "MONSTACK_INCLUDE", "include", _parse_rules,
        "module names or path prefixes, separated by commas or os.pathsep", "none",
        "Also track these modules/paths (the longest matching include/exclude rule wins).",
        "--include", True,
    ),
    Setting(
        "MONSTACK_EXCLUDE", "exclude", _parse_rules,
        "module names or path prefixes, separated by commas or os.pathsep", "none",
        "Do not track these modules/paths.", "--exclude", True,
    ),
    Setting(
        "MONSTACK_CHAIN_LIMIT", "chain_limit", _parse_chain_limit, "a whole number >= 1", "8",
        "How many origin hops a snapshot keeps (older hops are dropped and counted).",
        "--chain-limit",
    ),
    Setting(
        "MONSTACK_PROPAGATE", "propagate", _parse_propagate,
        "1/true/yes/on/all, 0/false/no/off/none, or a comma-separated list of propagation points",
        "all",
        "Which propagation points install() patches (" + ", ".join(PROPAGATION_POINTS) + ").",
        "--propagate",
    ),
    Setting(
        "MONSTACK_ACCELERATOR", "accelerator", _parse_accelerator,
        "auto, 1/true/yes/on, 0/false/no/off", "auto",
        "Native sys.monitoring callbacks on CPython 3.12-3.15 (auto: where they can run).",
        "--accelerator",
    ),
    Setting(
        "MONSTACK_NOTES", "notes", _parse_switch, "1/true/yes/on, 0/false/no/off", "0",
        "Also add each origin to its exception as a PEP 678 note where the work fails "
        "(never under pytest).",
        "--notes",
    ),
    Setting(
        "MONSTACK_COLOR", None, _parse_color,
        "auto, always (or 1/yes/true/on), never (or 0/no/false/off)", "auto",
        "Colour in monstack's own reports; auto follows CPython's rules "
        "(PYTHON_COLORS, NO_COLOR, FORCE_COLOR, TERM, isatty).",
        "--color",
    ),
    Setting(
        "MONSTACK_DUMP_SIGNAL", None, _parse_signal,
        "a signal name such as USR1, USR2 or QUIT (with or without SIG)", "none",
        "A signal that makes the process write every thread's stack and origin (stderr, or "
        "to python -m monstack dump).",
        "--dump-signal",
    ),
    Setting(
        STARTUP_CACHE_ENV, None, _parse_switch, "1/true/yes/on, 0/false/no/off", "on",
        "The MONSTACK=1 start-up cache (off: the boot imports monstack through the import "
        "system, and neither reads nor writes the cache file).",
    ),
)


#: ``MONSTACK_*`` variables read by the test suite, the bench and the tools, never by the
#: package at start-up (docs/configuration.md, "Variables for developers"): not misspellings.
INTERNAL_VARS: tuple[str, ...] = (
    "MONSTACK_BENCH_NO_REHEARSAL",  # the bench's own (monstack._bench._harness), not a setting
    "MONSTACK_TEST_CONFIG",
    "MONSTACK_ORACLE_EXAMPLES",
    "MONSTACK_STRESS",
    "MONSTACK_STRESS_CALLS",
    "MONSTACK_COMPAT_MODE",
    "MONSTACK_COMPAT_LOG",
    "MONSTACK_MULTIARCH_INCLUDE",
)


def _distance(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions; a swap of neighbours counts
    one): difflib would import more than start-up should."""
    previous2: list[int] = []
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        row = [i]
        for j, cb in enumerate(b, 1):
            cost = min(previous[j] + 1, row[j - 1] + 1, previous[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cost = min(cost, previous2[j - 2] + 1)
            row.append(cost)
        previous2, previous = previous, row
    return previous[-1]


def unknown_variable(name: str) -> Optional[str]:
    """The message for a ``MONSTACK_*`` variable monstack does not read (a misspelling,
    most likely) naming the closest one it does; None for a known or internal one."""
    known = [ENABLE_VAR] + [setting.var for setting in SETTINGS]
    if not name.startswith(ENABLE_VAR + "_") or name in known or name in INTERNAL_VARS:
        return None
    closest = min(known, key=lambda var: (_distance(name, var), var))
    return f"{name} is not a monstack variable; did you mean {closest}?"


class Config:
    """What the environment asks for."""

    __slots__ = ("enabled", "options", "values", "problems")

    def __init__(self) -> None:
        self.enabled = False
        #: ``install()`` keywords, only for variables that are set and valid.
        self.options: dict[str, Any] = {}
        #: Parsed value of every set-and-valid variable, by variable name.
        self.values: dict[str, Any] = {}
        #: One warning's text (its id first: ``_problem``) per bad variable.
        self.problems: list[str] = []


def _problem(slug: str, text: str) -> str:
    """A warning's text: its id (docs/messages.md), then what is wrong. ``_errors.message``
    spelled here, as this module imports nothing (a test compares the two)."""
    return f"{slug}: {text}"


def _bad(var: str, raw: str, valid: str, default: str) -> str:
    return f"{var}={raw!r} is not valid (valid values: {valid}); using the default ({default})"


def parse_enabled(raw: Optional[str]) -> tuple[bool, Optional[str]]:
    """``MONSTACK``'s value -> (on?, problem message or None). Unknown values mean off."""
    value = (raw or "").strip().lower()
    if value in TRUE_VALUES:
        return True, None
    if value in FALSE_VALUES:
        return False, None
    valid = "/".join(TRUE_VALUES) + " to turn monstack on; unset or " + "/".join(v for v in FALSE_VALUES if v)
    return False, f"{ENABLE_VAR}={raw!r} is not valid (valid values: {valid}); monstack stays off"


def read_env(environ: Optional[Mapping[str, str]] = None) -> Config:
    """Parse ``MONSTACK`` and every ``MONSTACK_*`` row of :data:`SETTINGS`; never raises
    for bad values (they become ``problems``)."""
    env = os.environ if environ is None else environ
    config = Config()
    config.enabled, problem = parse_enabled(env.get(ENABLE_VAR))
    if problem:
        config.problems.append(_problem("monstack-bad-value", problem))
    for setting in SETTINGS:
        raw = env.get(setting.var)
        if raw is None or not raw.strip():
            continue
        try:
            value = setting.parse(raw)
        except BadValue as exc:
            config.problems.append(_problem("monstack-bad-value", _bad(setting.var, raw, exc.valid, setting.default)))
            continue
        config.values[setting.var] = value
        if setting.option is not None:
            config.options[setting.option] = value
    for name in env:
        problem = unknown_variable(name)
        if problem is not None:
            config.problems.append(_problem("monstack-unknown-variable", problem))
    if "backend" not in config.options:
        # Explicit, so install() does not read a bad MONSTACK_BACKEND again and raise.
        config.options["backend"] = "auto"
    return config


def env_color(environ: Optional[Mapping[str, str]] = None) -> Optional[bool]:
    """``MONSTACK_COLOR`` as a ``color`` argument: True, False, or None (auto / unset / bad)."""
    raw = (os.environ if environ is None else environ).get(COLOR_ENV)
    if not raw:
        return None
    try:
        return _parse_color(raw)
    except BadValue:
        return None


def env_dump_signal(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """``MONSTACK_DUMP_SIGNAL`` as ``"SIGUSR1"``, or None when unset, empty or bad."""
    raw = (os.environ if environ is None else environ).get(DUMP_SIGNAL_ENV)
    if not raw or not raw.strip():
        return None
    try:
        return _parse_signal(raw)
    except BadValue:
        return None


def env_backend() -> Optional[str]:
    """The backend named in ``MONSTACK_BACKEND``, or None when unset/empty."""
    value = os.environ.get(BACKEND_ENV, "").strip().lower()
    return value or None


def env_accelerator_off() -> bool:
    """``MONSTACK_ACCELERATOR=0`` (or false/no/off) turns the native callbacks off."""
    return os.environ.get(ACCELERATOR_ENV, "").strip().lower() in ("0", "false", "no", "off")


def to_environ(values: Mapping[str, str], environ: Optional[MutableMapping[str, str]] = None) -> None:
    """Turn monstack on in ``environ`` (default ``os.environ``) with ``values`` (variable ->
    text), so child Python processes start with the same settings."""
    env = os.environ if environ is None else environ
    env[ENABLE_VAR] = "1"
    for var, text in values.items():
        env[var] = text
