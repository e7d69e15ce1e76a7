"""Every MonstackWarning has a stable id at the start of its text, given where it is issued
(``_errors.warn``/``warn_once``/``message``), and docs/messages.md lists each id once; a
warning filter picks a warning by its id."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from monstack import MonstackWarning, _errors, _settings

REPO = Path(__file__).resolve().parents[2]
ID = re.compile(r"monstack(-[a-z]+)+")
#: The functions of _errors that take an id as their first argument.
TAKE_AN_ID = {"warn", "warn_once", "message"}


def ids_in(source: str, rel: str) -> tuple[set[str], list[str]]:
    """(the ids given to _errors' functions in ``source``, the calls that give no literal id).
    ``_settings`` imports nothing: its ``_problem`` spells ``_errors.message``."""
    tree = ast.parse(source)
    names = {"_problem": "message"} if rel == "monstack/_settings.py" else {}  # local name -> _errors function
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] == "_errors":
            for alias in node.names:
                if alias.name in TAKE_AN_ID:
                    names[alias.asname or alias.name] = alias.name
    ids, bad = set(), []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in names:
            pass
        elif (isinstance(func, ast.Attribute) and func.attr in TAKE_AN_ID and isinstance(func.value, ast.Name)
              and func.value.id == "_errors"):
            pass
        else:
            continue
        first = node.args[0] if node.args else None
        if isinstance(first, ast.Constant) and isinstance(first.value, str) and ID.fullmatch(first.value):
            ids.add(first.value)
        else:
            bad.append(f"{rel}:{node.lineno}: {ast.get_source_segment(source, node)}")
    return ids, bad


def ids_in_code() -> set[str]:
    found, bad = set(), []
    paths = sorted((REPO / "monstack").rglob("*.py")) + sorted(REPO.glob("_monstack_*.py"))
    for path in paths:
        rel = path.relative_to(REPO).as_posix()
        if rel == "monstack/_errors.py":  # (passes its callers' ids along)
            continue
        ids, no_id = ids_in(path.read_text(encoding="utf-8"), rel)
        found |= ids
        bad += no_id
    assert not bad, "give each warning a literal id (docs/messages.md):\n" + "\n".join(bad)
    return found


def ids_in_docs() -> list[str]:
    text = (REPO / "docs" / "messages.md").read_text(encoding="utf-8")
    return re.findall(r"^## (\S+)$", text, re.M)


def test_the_docs_list_every_id_of_the_code_once_in_order():
    code, docs = ids_in_code(), ids_in_docs()
    assert all(ID.fullmatch(i) for i in docs), docs
    assert len(docs) == len(set(docs)) and docs == sorted(docs), docs
    assert sorted(code - set(docs)) == [], "ids missing from docs/messages.md"
    assert sorted(set(docs) - code) == [], "ids in docs/messages.md that the code never gives"


def test_no_id_starts_another():
    """A message filter matches the start of the text: ``ignore:monstack-x`` must not also
    silence ``monstack-x-y``."""
    docs = ids_in_docs()
    assert not [(a, b) for a in docs for b in docs if a != b and b.startswith(a)]


def test_the_id_finder():
    source = ("from ._errors import warn_once as warn, message\nfrom . import _errors\n"
              "warn('monstack-a-b', 'x')\n_errors.warn('monstack-c', f'{y}')\nmessage('monstack-d', 'z')\n"
              "warnings.warn('not ours')\nwarn(slug, 'x')\n")
    ids, bad = ids_in(source, "m.py")
    assert ids == {"monstack-a-b", "monstack-c", "monstack-d"}
    assert bad == ["m.py:7: warn(slug, 'x')"]


def test_settings_spell_a_message_as_errors_does():
    assert _settings._problem("monstack-x", "text") == _errors.message("monstack-x", "text")


def test_settings_problems_carry_ids():
    config = _settings.read_env({"MONSTACK": "maybe", "MONSTACK_TRACK": "bogus", "MONSTACK_TRAK": "all"})
    docs = set(ids_in_docs())
    assert len(config.problems) == 3
    assert all(p.split(": ", 1)[0] in docs for p in config.problems), config.problems


def test_warnings_start_with_their_id_and_a_filter_picks_them():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message="monstack-internal-error")
        _errors.warn("monstack-internal-error", "silenced by its id")
        _errors.warn("monstack-uninstall-failed", "shown")
    assert [str(w.message) for w in caught] == ["monstack-uninstall-failed: shown"]
    assert caught[0].category is MonstackWarning


def _start(*args: str, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MONSTACK", "PYTHONWARNINGS"))}
    env.update(MONSTACK="1", MONSTACK_TRAK="all", MONSTACK_TRACK="bogus", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "monstack" / "_boot"), str(REPO)])
    return subprocess.run([sys.executable, *args, "-c", "pass"], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("how", ["-W", "PYTHONWARNINGS"])
def test_a_start_up_warning_is_silenced_by_its_id_alone(how):
    if how == "-W":
        out = _start("-W", "ignore:monstack-unknown-variable")
    else:
        out = _start(PYTHONWARNINGS="ignore:monstack-unknown-variable")
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("MonstackWarning: monstack-bad-value: MONSTACK_TRACK='bogus'"), lines
    # and without the filter, both (no location made up, "monstack" once before the id)
    both = _start().stderr.splitlines()
    assert sorted(line.split(": ")[1] for line in both) == ["monstack-bad-value", "monstack-unknown-variable"], both
