"""The lists the docs copy from the code, checked against the code (coverage.py keeps its
docs in step with cog; here the tests read the tables and compare).

- docs/design.md's layer table against ``LAYERS`` in tests/unit/test_layers.py;
- the ``MONSTACK_*`` tables (README.md, docs/configuration.md) against
  ``monstack._settings.SETTINGS`` and ``INTERNAL_VARS``;
- the propagation points' tables (README.md "Automatic", docs/origins.md, and the list in
  docs/configuration.md's ``MONSTACK_PROPAGATE`` row) against ``monstack.PROPAGATION_POINTS``.

When one of these fails, the doc (or the code) changed without the other: fix the doc.
"""

from __future__ import annotations

import re
from pathlib import Path

import monstack
from monstack import _settings

ROOT = Path(__file__).resolve().parents[2]

_CELL_SPLIT = re.compile(r"(?<!\\)\|")
_CODE = re.compile(r"`([^`]+)`")


def table_after(doc: str, heading: str) -> list[list[str]]:
    """The rows (cells stripped, header and rule left out) of the first Markdown table
    after the line ``heading`` in ``doc`` (a path below the repository's root)."""
    lines = (ROOT / doc).read_text(encoding="utf-8").splitlines()
    assert heading in lines, f"{doc}: no line {heading!r} (renamed? update tests/unit/test_docs.py)"
    rows: list[list[str]] = []
    for line in lines[lines.index(heading) + 1:]:
        if line.startswith("#") and not rows:
            break  # the next section began: no table under this heading
        if line.startswith("|"):
            rows.append([cell.strip() for cell in _CELL_SPLIT.split(line.strip())[1:-1]])
        elif rows:
            break
    assert len(rows) > 2, f"{doc}: no table after {heading!r}"
    assert set(rows[1][0]) <= set("-: "), f"{doc}: the table after {heading!r} has no header rule"
    return rows[2:]


def names_in(cell: str) -> list[str]:
    """The names written as code in a cell (```a`, `b``` -> ``["a", "b"]``)."""
    return _CODE.findall(cell)


# -- the layers ------------------------------------------------------------------------------


def test_the_layer_table_is_the_layer_test():
    from test_layers import LAYERS

    rows = table_after("docs/design.md", "## Layering")
    assert [row[0].split()[0] for row in rows] == [f"L{i}" for i in range(len(LAYERS))], "one row per layer, L0 first"
    for i, (row, layer) in enumerate(zip(rows, LAYERS)):
        listed = names_in(row[1])
        assert sorted(listed) == sorted(layer), (
            f"docs/design.md, layer L{i}: lists {sorted(listed)}, tests/unit/test_layers.py has {sorted(layer)}"
        )
        assert len(listed) == len(set(listed)), f"docs/design.md, layer L{i}: a module listed twice"


# -- the variables ---------------------------------------------------------------------------


def _variables(rows: list[list[str]]) -> dict[str, str]:
    """variable -> its default cell, for every ``MONSTACK*`` name in a table's first column."""
    out: dict[str, str] = {}
    for row in rows:
        for name in names_in(row[0]):
            assert name.startswith("MONSTACK"), name
            assert name not in out, f"{name} listed twice"
            out[name] = row[2].replace("`", "")
    return out


def test_the_readme_table_lists_the_variables_run_has_an_option_for():
    """README.md's short table: every variable ``python -m monstack run`` has an option
    for, with its default (docs/configuration.md has every variable)."""
    listed = _variables(table_after("README.md", "## Turn it on without changing the program"))
    expected = {s.var: s.default for s in _settings.SETTINGS if s.flag is not None}
    assert sorted(listed) == sorted(expected)
    assert listed == expected, "a default in README.md differs from _settings.SETTINGS"


def test_the_configuration_table_lists_every_user_variable():
    listed = _variables(table_after("docs/configuration.md", "## `MONSTACK=1`"))
    expected = {_settings.ENABLE_VAR: "off", **{s.var: s.default for s in _settings.SETTINGS}}
    assert sorted(listed) == sorted(expected)
    assert listed == expected, "a default in docs/configuration.md differs from _settings.SETTINGS"


def test_the_developers_table_lists_the_internal_variables_and_nothing_else():
    listed = [name for row in table_after("docs/configuration.md", "## Variables for developers")
              for name in names_in(row[0])]
    assert sorted(listed) == sorted(_settings.INTERNAL_VARS)
    users = {_settings.ENABLE_VAR, *(s.var for s in _settings.SETTINGS)}
    assert not users & set(_settings.INTERNAL_VARS), "a user's variable is not internal"


# -- the propagation points ------------------------------------------------------------------


def _points(rows: list[list[str]]) -> list[str]:
    out = []
    for row in rows:
        names = names_in(row[0])
        assert len(names) == 1, f"not one point, as code, in the first column: {row[0]!r}"
        out.extend(names)
    assert len(out) == len(set(out)), f"a point listed twice: {out}"
    return out


def test_the_readme_lists_every_propagation_point():
    listed = _points(table_after("README.md", "### Automatic"))
    assert sorted(listed) == sorted(monstack.PROPAGATION_POINTS)


def test_the_origins_reference_lists_every_propagation_point():
    listed = _points(table_after("docs/origins.md", "### The propagation points"))
    assert sorted(listed) == sorted(monstack.PROPAGATION_POINTS)


def test_the_propagate_variable_lists_every_propagation_point():
    [row] = [row for row in table_after("docs/configuration.md", "## `MONSTACK=1`")
             if names_in(row[0]) == ["MONSTACK_PROPAGATE"]]
    listed = [name for name in names_in(row[1].split("comma-separated list of", 1)[1])]
    assert sorted(listed) == sorted(monstack.PROPAGATION_POINTS)
    [setting] = [s for s in _settings.SETTINGS if s.var == "MONSTACK_PROPAGATE"]
    for name in monstack.PROPAGATION_POINTS:  # what `run --help` says
        assert re.search(rf"\b{name}\b", setting.doc), name


def test_the_readme_stays_short():
    """The README is for users (what, install, use, cost at a glance): at most 450 lines; a
    feature gets a short section there and its reference in docs/."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 450, f"README.md has {len(lines)} lines: move reference material to docs/"
