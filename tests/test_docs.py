"""The documentation: README.md stays a first page, and every relative link in it and in docs/ resolves.

    python -m pytest -q tests/test_docs.py

A link is `[text](target)`. Links to http(s) and mailto, and links to an anchor of the same page, are not checked.
Any other target must exist relative to the file that holds the link; a `#fragment` into a Markdown file must be the
GitHub slug of one of its headings.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200  # a first page: nanoGPT's README is 234 lines, Accelerate's 277

LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")
EXTERNAL = ("http://", "https://", "mailto:")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, where a `[x](y)` is code, not a link."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def links(path: Path) -> list[tuple[int, str]]:
    # Inline code is stripped first: `[a](b)` inside backticks is an example, not a link.
    return [
        (number, target) for number, line in prose_lines(path) for target in LINK.findall(re.sub(r"`[^`]*`", "", line))
    ]


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lowercase, markup and punctuation other than - and _ dropped, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's slug; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    result = set()
    for _, line in prose_lines(path):
        if match := HEADING.match(line):
            slug = github_slug(match.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def broken_links(path: Path) -> list[str]:
    problems = []
    for number, target in links(path):
        if target.startswith(EXTERNAL) or target.startswith("#"):
            continue
        file_part, _, fragment = target.partition("#")
        resolved = (path.parent / file_part).resolve()
        where = f"{path.relative_to(ROOT)}:{number}: [{target}]"
        if not resolved.exists():
            problems.append(f"{where} -> {file_part} does not exist")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            problems.append(f"{where} -> no heading in {file_part} has the anchor #{fragment}")
    return problems


def test_readme_is_a_first_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, more than {README_MAX_LINES}: move the detail into a page in docs/"
    )


def test_readme_links_every_docs_page():
    linked = {(ROOT / target.partition("#")[0]).resolve() for _, target in links(ROOT / "README.md")}
    missing = [str(page.relative_to(ROOT)) for page in markdown_files()[1:] if page.resolve() not in linked]
    assert not missing, f"README.md links to no {', '.join(missing)}"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    problems = broken_links(path)
    assert not problems, "\n".join(problems)


def test_slugs_follow_github():
    assert github_slug("Why Accelerate's own AMP is off") == "why-accelerates-own-amp-is-off"
    assert github_slug("3. Fallback") == "3-fallback"
    assert github_slug("torch.compile") == "torchcompile"
    assert github_slug("AMP off vs on (compare_amp)") == "amp-off-vs-on-compare_amp"
    assert (
        github_slug("Launcher setting x app flag -> what actually runs")
        == "launcher-setting-x-app-flag---what-actually-runs"
    )
