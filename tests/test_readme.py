"""README.md and docs/*.md: short README, the two commands first, no dead links, no bare radixkv.

Reads files only (no server, no model), so it runs in well under a second.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

FENCE = re.compile(r"^```(\w*)")
#: [text](target) and ![alt](target); the target ends at the first space or ")".
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def blocks(text: str) -> list[tuple[str, list[str]]]:
    """The fenced code blocks of a markdown text: (info string, lines)."""
    out: list[tuple[str, list[str]]] = []
    current: list[str] | None = None
    for line in text.splitlines():
        m = FENCE.match(line)
        if m and current is None:
            current = []
            out.append((m.group(1), current))
        elif line.startswith("```") and current is not None:
            current = None
        elif current is not None:
            current.append(line)
    return out


def prose(text: str) -> list[str]:
    """The lines of a markdown text outside fenced code blocks."""
    lines, inside = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            inside = not inside
        elif not inside:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a markdown file (repeats get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose(page.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    """Relative link targets of a page (outside code blocks; no URLs, no mailto)."""
    text = "\n".join(prose(page.read_text(encoding="utf-8")))
    text = re.sub(r"`[^`]*`", "", text)  # inline code is not a link
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 400, f"README.md has {len(lines)} lines (at most 400)"


def test_readme_starts_with_the_two_commands():
    (info, first), *_ = blocks(README.read_text(encoding="utf-8"))
    assert info == "bash"
    assert any(line.startswith("bash setup.sh") for line in first), first
    assert any(line.startswith(".venv/bin/python -m pytest -q") for line in first), first
    # .ci/run runs the same test command
    assert ".venv/bin/python -m pytest -q" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_quickstart_is_on_the_first_screen_and_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("## Quickstart"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    # HTML comments (the run-by-test markers) do not render
    body = [ln for ln in lines[start + 1 : end] if ln.strip() and not ln.startswith("<!--")]
    assert start < 40, f"the quickstart starts at line {start + 1}"
    assert len(body) <= 15, f"the quickstart has {len(body)} lines (at most 15)"
    text = "\n".join(body)
    assert ".venv/bin/radixkv serve" in text
    assert "curl" in text and "/v1/chat/completions" in text
    assert "from openai import OpenAI" in text


def test_relative_links_point_to_existing_files_and_anchors():
    bad = []
    for page in PAGES:
        for target in links(page):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "dead links:\n" + "\n".join(bad)


def test_commands_use_the_venv():
    bare = []
    for page in PAGES:
        for info, lines in blocks(page.read_text(encoding="utf-8")):
            if info not in ("bash", "sh", "console"):
                continue
            for line in lines:
                command = line.removeprefix("$ ")
                if command.startswith(("radixkv ", "python -m ", "python bench/")):
                    bare.append(f"{page.relative_to(ROOT)}: {line}")
    assert not bare, "write .venv/bin/radixkv and .venv/bin/python:\n" + "\n".join(bare)
