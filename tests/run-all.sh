#!/usr/bin/env bash
# Run the test suite on every supported CPython (3.11 to 3.15) found on this machine, in
# every configuration (`tests/configs.py` lists them: native and pure-Python
# callbacks where both exist), then mypy once on 3.12. Each interpreter gets a venv under
# .venvs/ with monstack installed (editable) plus its test, integration (trio, uvloop) and
# engines (dask, celery[redis], rq, ray) extras; the tests marked `integration` run once per CPython, in its first
# configuration only. Fails if any run fails.
# A supported interpreter that is missing is skipped with a message, except in CI
# (CI=true), where it fails the run. Extra arguments go to pytest.
set -u
cd "$(dirname "$0")/.."
root=$(pwd)
want=(3.11 3.12 3.13 3.14 3.15)

find_python() {  # $1 = 3.X ; prints a path or nothing
  local v=$1 c
  if command -v pyenv >/dev/null 2>&1; then
    for c in "$(pyenv root)"/versions/"$v".*/bin/python"$v"; do
      [ -x "$c" ] && { echo "$c"; return; }
    done
  fi
  c=$(command -v "python$v" 2>/dev/null) && [ -n "$c" ] && "$c" -c 'import sys' 2>/dev/null && { echo "$c"; return; }
  return 0
}

status=0
summary=()
for v in "${want[@]}"; do
  py=$(find_python "$v")
  if [ -z "$py" ]; then
    echo "!! CPython $v not found (tried pyenv versions and python$v on PATH)" >&2
    if [ "${CI:-}" = "true" ]; then
      summary+=("$v: MISSING"); status=1
    else
      summary+=("$v: skipped (not installed here; CI requires it)")
    fi
    continue
  fi
  venv="$root/.venvs/py$v"
  echo "== CPython $v: $py"
  if [ ! -x "$venv/bin/python" ]; then
    "$py" -m venv "$venv" || { summary+=("$v: venv failed"); status=1; continue; }
  fi
  # The integration extra (trio, uvloop) and the engines extra (dask, celery[redis], rq, ray) where they install;
  # where one cannot, its tests skip with the reason (and fail in CI, except for an engine
  # with no release for this CPython: see engine_module() in tests/conftest.py).
  if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$root[test,integration,engines]"; then
    echo "!! CPython $v: the integration or engines extra did not install (their tests skip; CI fails them)" >&2
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$root[test,integration]" \
      || "$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$root[test]" \
      || { summary+=("$v: install failed"); status=1; continue; }
  fi
  first=1
  configs=$("$venv/bin/python" "$root/tests/configs.py") \
    || { echo "!! CPython $v: tests/configs.py failed" >&2; summary+=("$v: tests/configs.py failed"); status=1; continue; }
  for run in $configs; do
    echo "-- CPython $v, configuration: $run"
    marks=()
    [ $first = 1 ] || marks=(-m "not integration")  # integration tests: first configuration only
    first=0
    MONSTACK_TEST_CONFIG=$run "$venv/bin/python" -m pytest -q -p no:cacheprovider ${marks[@]+"${marks[@]}"} "$@"
    rc=$?
    # only integration tests were asked for: none left in the other configurations
    [ $rc -eq 5 ] && [ ${#marks[@]} -gt 0 ] && rc=0
    if [ $rc -ne 0 ]; then summary+=("$v/$run: FAILED (pytest exit $rc)"); status=1
    else summary+=("$v/$run: passed"); fi
  done
done
# The backend contract and the rest of the package, type-checked once (pyproject's [tool.mypy]).
typecheck=3.12
venv="$root/.venvs/py$typecheck"
if [ -x "$venv/bin/python" ]; then
  echo "== mypy (CPython $typecheck)"
  if "$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$root[test,typecheck]" \
      && "$venv/bin/python" -m mypy; then
    summary+=("mypy: passed")
  else
    summary+=("mypy: FAILED"); status=1
  fi
fi

echo "== summary"
printf '  %s\n' "${summary[@]}"
exit $status
