"""The project's own documents speak of the project (issue 43).

* The README is a front door (issue 53): at most 150 lines, and every page of docs/ it links to exists.
* The "Layout" section (in docs/architecture.md since issue 53; the README was its home before) says where each part of
  hf_dp lives: every package of the library is named there, and every file or folder it names exists (a rename that
  the prose missed fails here).
* No document names a scratch folder of one machine (the system's temporary directory, the machine's checkout path)
  or speaks of a "session": a result names the repo-relative place of its raw file, or none.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _layout() -> str:
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    start = text.index("\n## Layout\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_every_library_package_is_named_in_the_layout():
    layout = _layout()
    packages = sorted(p.parent.relative_to(REPO).as_posix() for p in (REPO / "hf_dp").glob("*/__init__.py"))
    missing = [p for p in packages if f"`{p}/" not in layout]
    assert not missing, f"docs/architecture.md's Layout does not name the packages {missing}"


def test_every_path_the_layout_names_exists():
    layout = _layout()
    named = set(re.findall(r"`((?:hf_dp|recipes|benchmarks|tests|docs|model_cards)/[^`\s]*)`", layout))
    # a short name after a package (`hf_dp/run/`: `contract.py`, ...) is that package's file, up to the next package
    parts = re.split(r"`((?:hf_dp|recipes)/(?:\w+/)*)`", layout)
    for pkg, body in zip(parts[1::2], parts[2::2]):
        named |= {pkg + name for name in re.findall(r"`(\w+\.py)`", body.split("\n* ")[0])}
    assert len(named) > 20
    gone = sorted(p for p in named if not (REPO / p).exists())
    assert not gone, f"docs/architecture.md's Layout names files that do not exist: {gone}"


def test_the_readme_is_a_front_door_of_at_most_150_lines():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines: move detail into a docs/ page"


def test_every_docs_page_the_readme_or_a_docs_page_links_exists():
    """README links ``docs/*.md`` pages (and anchors in them); the docs pages link each other by relative paths."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    named = set(re.findall(r"\b(docs/[\w./-]+\.md)", readme))
    assert len(named) >= 10, named
    gone = sorted(p for p in named if not (REPO / p).is_file())
    for page, anchor in re.findall(r"\b(docs/[\w./-]+\.md)#([\w-]+)", readme):  # GitHub's heading anchors
        headings = re.findall(r"^#+ (.+)$", (REPO / page).read_text(encoding="utf-8"), re.M) if (REPO / page).is_file() else []
        if anchor not in {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}:
            gone.append(f"{page}#{anchor}")
    for page in sorted((REPO / "docs").glob("*.md")):
        for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" not in target and not (page.parent / target).resolve().is_file():
                gone.append(f"{page.name} -> {target}")
    assert not gone, f"links to pages that do not exist: {gone}"


def test_no_document_names_a_scratch_folder_of_one_machine_or_a_session():
    docs = [REPO / "README.md", *REPO.glob("docs/**/*.md"), *REPO.glob("benchmarks/*.md"), *REPO.glob("recipes/**/*.md"),
            *REPO.glob("model_cards/*")]
    scratch = re.compile(r"(?<![\w.])/tmp/|(?<![\w.])/work/|\bsessions?\b", re.IGNORECASE)
    found = [f"{p.relative_to(REPO)}:{i}: {line.strip()[:100]}" for p in docs if p.is_file()
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if scratch.search(line)]
    assert len(docs) > 5 and not found, "\n".join(found)


def test_two_process_runs_start_from_one_launcher():
    """Issue 43: the torchrun command, its environment and the workers' preamble live in tests/two_process.py only."""
    here = REPO / "tests"
    copies = [p.name for p in sorted(here.glob("*.py")) if p.name != "two_process.py"
              and re.search(r"\"torch\.distributed\.run\"|os\.environ\[\"RANK\"\]|sys\.path\.insert\(0, \{tests!r\}\)", p.read_text())]
    assert not copies, f"a two-process launcher or worker preamble of its own in {copies}"


def test_what_collection_imported_is_out_of_the_collectors_full_passes():
    """tests/conftest.py freezes what collection imported: a full ``gc.collect()`` walks only what the tests made since
    (before: about half a million objects, a second or more per full pass, tens of seconds per file)."""
    import gc

    assert gc.get_freeze_count() > 50_000
