"""The README and the pages under docs/: every relative link reaches a file (and, when it names
one, a heading of that file), and prose stays readable: no line over 160 characters outside code
blocks, table rows over 400. Pure: reads the markdown files only."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

MAX_LINE = 160
MAX_TABLE_ROW = 400

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`[^`]*`")
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced and indented code blocks."""
    out: list[tuple[int, str]] = []
    fenced = False
    indented = False
    previous_blank = True
    for number, line in enumerate(text.split("\n"), start=1):
        if line.startswith("```"):
            fenced = not fenced
            previous_blank = False
            continue
        if fenced:
            continue
        indented = line.startswith("    ") and (previous_blank or indented)
        previous_blank = not line.strip()
        if not indented:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line in prose_lines(page.read_text(encoding="utf-8")):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match is None:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(page: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link in the page's prose; a link's text and a code span
    may run over a line break, so the prose is searched as one text."""
    lines = prose_lines(page.read_text(encoding="utf-8"))
    numbers = [number for number, _ in lines]
    prose = "\n".join(line for _, line in lines)
    # a code span becomes blanks of the same lines, so what it quotes is never a link
    prose = CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), prose)
    return [(numbers[prose.count("\n", 0, m.start())], m.group(1)) for m in LINK.finditer(prose)]


def broken_links(page: Path) -> list[str]:
    broken = []
    for number, target in links(page):
        if SCHEME.match(target):
            continue  # a web address: not checked offline
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        where = f"{page.name}:{number}: {target}"
        if not dest.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{where} (no heading with that anchor in {dest.name})")
    return broken


def test_pages_exist() -> None:
    assert (ROOT / "README.md").is_file()
    assert len(PAGES) > 1, "docs/ holds the manual's pages"
    assert any(target.startswith("docs/") for _, target in links(ROOT / "README.md"))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = broken_links(page)
    assert not broken, "broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_lines_stay_readable(page: Path) -> None:
    long = []
    for number, line in prose_lines(page.read_text(encoding="utf-8")):
        limit = MAX_TABLE_ROW if line.lstrip().startswith("|") else MAX_LINE
        if len(line) > limit:
            long.append(f"{page.relative_to(ROOT)}:{number}: {len(line)} characters")
    assert not long, (
        f"lines over {MAX_LINE} characters (table rows: {MAX_TABLE_ROW}):\n" + "\n".join(long)
    )


def test_the_checks_see_what_they_check(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A `b`, c\n\n## A `b`, c\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n    [x](nowhere.md)\n\n```\n[y](nowhere.md)\n```\n"
        "[z](a.md#a-b-c-1) `[w](v)` [web](https://example.com/x)\n"
        "[missing](gone.md) [bad anchor](a.md#nothing) [here](#page) [over a\n"
        "line break](gone.md) `code over a\nbreak [q](gone.md)`\n",
        encoding="utf-8",
    )
    assert anchors(tmp_path / "a.md") == {"a-b-c", "a-b-c-1"}
    assert [target for _, target in links(page)] == [
        "a.md#a-b-c-1",
        "https://example.com/x",
        "gone.md",
        "a.md#nothing",
        "#page",
        "gone.md",
    ]
    assert broken_links(page) == [
        "page.md:9: gone.md (no such file)",
        "page.md:9: a.md#nothing (no heading with that anchor in a.md)",
        "page.md:9: gone.md (no such file)",
    ]
