"""The README is a manual: short, the two quick-start commands first, and every relative
link in it and in the docs it leads to resolves to a file (and a heading, for #anchors)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 400
FIRST_COMMANDS = ["./quickstart.sh demo", "./quickstart.sh test"]

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^\s*(```|~~~)")


def _prose(text: str) -> str:
    """The text without fenced code blocks (links there are not links)."""
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return "\n".join(out)


def anchors(path: Path) -> set:
    """GitHub's anchors for a Markdown file's headings."""
    found, seen = set(), {}
    for line in _prose(path.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower().replace("`", "")).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def relative_links(path: Path) -> list:
    return [t for t in _LINK.findall(_prose(path.read_text(encoding="utf-8")))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto: ...


def broken_links(path: Path) -> list:
    bad = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
        elif anchor and dest.is_file() and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
        elif anchor and dest.is_dir() and anchor:
            bad.append(f"{path.relative_to(ROOT)}: {target} (an anchor into a folder)")
    return bad


def linked_markdown() -> list:
    """README.md and every Markdown file of this repository its links lead to, transitively."""
    todo, done = [README], []
    while todo:
        path = todo.pop()
        if path in done:
            continue
        done.append(path)
        for target in relative_links(path):
            dest = (path.parent / target.partition("#")[0]).resolve()
            if dest.is_file() and dest.suffix == ".md" and ROOT in dest.parents:
                todo.append(dest)
    return done


def test_the_readme_is_at_most_400_lines():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_the_readme_starts_with_the_two_commands():
    text = README.read_text(encoding="utf-8")
    block = re.search(r"```[a-z]*\n(.*?)```", text, re.S)
    assert block is not None and text.index(block.group(0)) < text.index("\n## "), "no code block before the first section"
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]
    assert commands == FIRST_COMMANDS


def test_every_relative_link_resolves():
    pages = linked_markdown()
    assert len(pages) > 1, "the README links to no other page"
    bad = [b for page in pages for b in broken_links(page)]
    assert not bad, "\n".join(bad)


def test_the_docs_are_reachable_from_the_readme():
    reached = set(linked_markdown())
    docs = sorted((ROOT / "docs").rglob("*.md")) + sorted((ROOT / "benchmarks" / "results").glob("*.md"))
    missing = [str(p.relative_to(ROOT)) for p in docs if p.resolve() not in reached]
    assert not missing, f"not linked from the README or the pages it leads to: {missing}"
