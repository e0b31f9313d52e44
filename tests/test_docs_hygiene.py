"""The user-facing text stays a product's: no development diary, no dead links, a README of one screen's
worth of answers.

- README, CHANGELOG, docs/, hf_zformer/ and scripts/ carry no words about how the project was developed
  (work sessions, issue numbers, worktrees, goals); hardware is named only as a fact about a figure.
- Every relative link of README.md and docs/*.md points at an existing file, and at an existing heading
  when it names one.
- README.md: at most 300 lines, an Install section, the results table in its first 120 lines.
- LICENSE exists; docs/bench keeps at most 60 files, none named after a development run.
"""

import re
from pathlib import Path

import pytest
from conftest import REPO_ROOT

# Case-insensitive. Each names a way the development process leaks into user-facing text.
PROCESS_PATTERNS = [
    r"\bsessions?\s+\d",          # "session 12", "sessions 11, 12"
    r"\bthis session\b",
    r"\b(?:issue|ticket)\s*#?\d",  # "issue 12", "issue #12"
    r"\bworktrees?\b",
    r"\bour goal\b",
    r"\bworking round\b",
    r"\bpinned (?:commit|worktree|checkout)\b",
    r"\bs1\d_components\b",
]
PROCESS = re.compile("|".join(PROCESS_PATTERNS), re.IGNORECASE)
SCANNED_SUFFIXES = {".md", ".py", ".json", ".yaml", ".yml", ".txt", ".cfg", ".toml"}


def _scanned_files():
    files = [REPO_ROOT / "README.md", REPO_ROOT / "CHANGELOG.md"]
    for folder in ("docs", "hf_zformer", "scripts"):
        files += sorted(p for p in (REPO_ROOT / folder).rglob("*") if p.is_file() and p.suffix in SCANNED_SUFFIXES)
    return [p for p in files if "__pycache__" not in p.parts and ".egg-info" not in str(p)]


def test_no_development_process_in_user_facing_text():
    hits = []
    for path in _scanned_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            match = PROCESS.search(line)
            if match:
                hits.append(f"{path.relative_to(REPO_ROOT)}:{number}: {match.group(0)!r} in {line.strip()[:120]}")
    assert not hits, "development-process wording in user-facing text:\n" + "\n".join(hits)


def test_patterns_catch_what_they_should():
    for text in ("measured in session 12", "Issue 14's target", "a pinned worktree", "Our goal of 88%",
                 "the working round", "this session's machine", "see s17_components/ab.py"):
        assert PROCESS.search(text), text
    for text in ("a seed of 42", "a session cookie", "round(x, 2)", "pinned memory"):
        assert not PROCESS.search(text), text


# The implementations hf_zformer follows have names (Zformer_Pytorch, Xformer_Pytorch, the
# FastFormer-pytorch and transformer-with-einsum reference code); "the seed" tells a reader nothing.
UNNAMED_SOURCE = re.compile(r"\bthe seed\b|\bseed's\b|\b(?:einsum|fastformer|pytorch)\s+seed\b", re.IGNORECASE)
# Files whose wording is still to be changed (docstrings of the attention classes).
UNNAMED_SOURCE_PENDING: set[str] = set()


def test_reference_implementations_are_named():
    files = _scanned_files() + sorted((REPO_ROOT / "tests").rglob("*.py"))
    hits = []
    for path in files:
        if str(path.relative_to(REPO_ROOT)) in UNNAMED_SOURCE_PENDING or path == Path(__file__):  # its own examples
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if UNNAMED_SOURCE.search(line):
                hits.append(f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()[:120]}")
    assert not hits, "'the seed' instead of the implementation's name:\n" + "\n".join(hits)


def test_unnamed_source_pattern_catches_what_it_should():
    for text in ("the seed's grid", "like the seed", "the einsum seed", "the FastFormer seed"):
        assert UNNAMED_SOURCE.search(text), text
    for text in ("--seed 42", "a random seed", "seeds 42 and 43", "split_seed"):
        assert not UNNAMED_SOURCE.search(text), text


def _slug(heading):
    """GitHub's anchor of a markdown heading."""
    heading = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def _anchors(path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#{1,6}\s+(.*?)\s*$", text, flags=re.M)}


DOC_PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        destination = (page.parent / file_part).resolve() if file_part else page
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in _anchors(destination):
            broken.append(f"{target}: no heading with anchor #{anchor} in {destination.name}")
    assert not broken, f"{page.relative_to(REPO_ROOT)}:\n" + "\n".join(broken)


def test_readme_shape():
    lines = (REPO_ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines (at most 300)"
    assert "## Install" in lines, "README.md needs an Install section"
    glance = lines.index("## Results at a glance")
    table = next(i for i in range(glance, len(lines)) if lines[i].startswith("| "))
    assert table < 120, f"the results table starts at line {table + 1} (within the first 120 lines)"
    for attention in ("full", "zformer", "xformer", "fastformer"):
        assert attention in lines[table], f"the results table has no {attention} column"


def test_license_exists():
    license_text = (REPO_ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0" in license_text


def test_docs_bench_is_small_and_named_by_content():
    from hf_zformer.folders import MARKER  # the list of the reports the scripts wrote there, not a report

    files = [p for p in (REPO_ROOT / "docs" / "bench").rglob("*")
             if p.is_file() and "__pycache__" not in p.parts and p.name != MARKER]
    assert len(files) <= 60, f"docs/bench holds {len(files)} files (at most 60)"
    run_names = re.compile(r"_s\d+[_.]|final\d*|run\d|session|before_after", re.IGNORECASE)
    bad = [str(p.relative_to(REPO_ROOT)) for p in files if run_names.search(p.name)]
    assert not bad, f"files named after development runs: {bad}"
