"""tests/, bench/ and tools/ say what they test or measure, not which of the project's issues
asked for it: an issue number means nothing to a reader of the code, and goes stale as the
issue moves on. CPython's issues are cited as ``gh-NNNNN``; another project's as
``owner/repo#N`` or ``project#N`` (``celery#N``), which these patterns leave alone.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHERE = ("tests", "bench", "tools")

#: The project's own issue numbers: "issue NN", "Issues NN, MM", "issue #NN", and a bare
#: "#NN" (not "gh-NN", "celery#NN", "python/cpython#NN"), NN being digits.
PATTERNS = (
    re.compile(r"\bissues?[ \t]*#?[0-9]+", re.IGNORECASE),
    re.compile(r"(?<![\w/.-])#[0-9]+\b"),
)

#: Files still to reword, left alone here because other branches touch them; once those
#: are merged, reword them and empty this set (a file here that no longer names an issue
#: fails the test, so the set cannot go stale).
PENDING: set[str] = set()


def issue_numbers(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line of ``text`` that names an issue by number."""
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1)
            if any(p.search(line) for p in PATTERNS)]


def files():
    root = ROOT
    for top in WHERE:
        for path in sorted((root / top).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts or ".pytest_cache" in path.parts:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):  # binary
                continue
            yield path.relative_to(root).as_posix(), text


def test_no_issue_numbers_in_tests_bench_and_tools():
    found = [f"{rel}:{n}: {line}" for rel, text in files() if rel not in PENDING
             for n, line in issue_numbers(text)]
    assert not found, "say what it tests instead of which issue asked for it:\n" + "\n".join(found)


def test_the_pending_files_still_need_rewording():
    texts = dict(files())
    done = sorted(rel for rel in PENDING if rel not in texts or not issue_numbers(texts[rel]))
    assert not done, f"reworded (or gone): take them out of PENDING: {done}"


def test_the_patterns():
    word, hash_ = "issue", "#"  # (built, so that this file names no issue itself)
    for bad in (f"({word} 24)", f"{word.title()} 20's target", f"{word}s 3, 7", f"{word} {hash_}5",
                f"see {hash_}10 here", f"# -- {word} 24: what libraries see"):
        assert issue_numbers(bad), bad
    for fine in ("gh-104405", "celery#9174", "python/cpython#149230", "an issue with 3 threads", "#!/bin/sh",
                 "# 3 rounds", "color: #fff", "issues of this kind"):
        assert not issue_numbers(fine), fine
