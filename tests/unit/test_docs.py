"""The documents a reader follows: every relative link of README.md, docs/*.md and jobs/README.md
reaches an existing file (and heading, where it names one); the README stays a front door (a
table of contents, at most 350 lines); docs/benchmarks.md opens with its headline table and stays
at most 600 lines; and no document narrates how the work was organised."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 350
# Words of how the work was organised, never of the product: work periods, numbered passes,
# issue numbers, work left for later, documents outside the repository.
HISTORY = re.compile(
    r"\bsessions? [0-9]|\bpass(es)? [0-9]|\bissues? [0-9#]|\bow[e]d\b|DESIGN\.md|STYLE\.md"
    r"|\b(first|second|third|[a-z]*(fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth"
    r"|teenth|tieth)|[0-9]+(st|nd|rd|th)) pass(es)?\b", re.I)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _documents() -> list[Path]:
    return [ROOT / "README.md", ROOT / "jobs" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _prose(text: str) -> str:
    """The text a reader sees as prose: fenced code blocks and inline code removed."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, flags=re.M):
        slug = _slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _show(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _broken_links(doc: Path) -> list[str]:
    broken = []
    for target in LINK.findall(_prose(doc.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):       # https:, mailto: ...: not ours to check
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {_show(dest)}")
    return broken


@pytest.mark.parametrize("doc", _documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_its_file_and_heading(doc):
    assert not _broken_links(doc), f"{doc.relative_to(ROOT)}: {_broken_links(doc)}"


def test_the_link_check_sees_a_broken_link_and_anchor(tmp_path):
    (tmp_path / "there.md").write_text("# Title\n\n## A heading: with `code`\n")
    doc = tmp_path / "doc.md"
    doc.write_text("[ok](there.md) [ok](there.md#a-heading-with-code) [ok](#local)\n\n## Local\n"
                   "[gone](missing.md) [bad](there.md#nowhere) `[code](not-a-link.md)`\n"
                   "[web](https://example.org/x.md)\n")
    assert _broken_links(doc) == [
        "missing.md: no such file", f"there.md#nowhere: no heading #nowhere in {tmp_path}/there.md"]


def test_the_readme_is_a_front_door_with_a_table_of_contents():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, over {README_MAX_LINES}: move reference to docs/")
    headings = re.findall(r"^## +(.+)$", _prose(text), flags=re.M)
    assert headings and headings[0] == "Contents", "README.md's first section is its contents"
    contents = text.split("\n## Contents\n", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"\]\(#([^)]+)\)", contents))
    missing = [h for h in headings[1:] if _slug(h) not in listed]
    assert not missing, f"README.md's contents do not list: {missing}"


def test_benchmarks_headline_rows_name_their_commands():
    """(Its length and the table's place: test_architecture.benchmarks_problems.)"""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    before_first_section = text.split("\n## ", 1)[0]
    tables = [line for line in before_first_section.splitlines() if line.startswith("|")]
    assert tables and tables[0].startswith("| topic | figure | method | reproduce |"), (
        "docs/benchmarks.md must open with the headline table (topic, figure, method, reproduce)")
    rows = tables[2:]
    assert len(rows) >= 8 and all(line.count("`") >= 2 for line in rows), (
        "each headline row names the command that reproduces it")


@pytest.mark.parametrize("doc", _documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_documents_describe_the_product_not_how_the_work_went(doc):
    hits = [f"{n}: {line.strip()[:80]}" for n, line in enumerate(doc.read_text().splitlines(), 1)
            if HISTORY.search(line)]
    assert not hits, f"{doc.relative_to(ROOT)} narrates history: {hits}"


CODE_HISTORY = re.compile(
    r"\bsessions? [0-9]|\bpass(es)? [0-9]|\bissues? [0-9#]|\bowed (a|on|to) (the )?device"
    r"|\boff since\b|DESIGN\.md|STYLE\.md|\.dev/", re.I)
"""The history words of code and scripts (``owed`` alone is a word of gradient reductions)."""


def _code_files() -> list[Path]:
    files = [p for top in ("mpipar", "kernels", "tests", "jobs", ".ci") for p in (ROOT / top).rglob("*")
             if p.is_file() and p.suffix in {".py", ".sh", ".sbatch", ""} and "__pycache__" not in p.parts]
    return [p for p in files if p.resolve() != Path(__file__).resolve()]


def history_in_code(files: list[Path]) -> list[str]:
    """``path:line`` of every line of ``files`` that narrates how the work was organised."""
    out = []
    for path in files:
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        out += [f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{n}"
                for n, line in enumerate(text.splitlines(), 1) if CODE_HISTORY.search(line)]
    return out


def test_code_and_scripts_describe_the_product_not_how_the_work_went():
    hits = history_in_code(_code_files())
    assert not hits, f"comments or strings narrate history: {hits}"


def test_the_code_history_check_sees_a_narrated_comment(tmp_path):
    bad = tmp_path / "k.py"
    narrated = "timed in " + "sess" + "ion 25, " + "ow" + "ed a device run"   # not a literal here
    bad.write_text(f"x = 1  # {narrated}\n# the gradient still owed\n")
    assert history_in_code([bad]) == [f"{bad}:1"]
