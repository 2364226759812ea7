"""The documentation: README.md stays a first page, every relative link in it and in docs/ resolves, and no long
sentence stands in two pages.

    python -m pytest -q tests/test_docs.py

A link is `[text](target)`. Links to http(s) and mailto, and links to an anchor of the same page, are not checked.
Any other target must exist relative to the file that holds the link; a `#fragment` into a Markdown file must be the
GitHub slug of one of its headings.

A sentence is prose outside fenced code blocks: a paragraph (its lines joined), a list item (with its continuation
lines), a heading or a table cell, with the Markdown markup taken off (a link or image keeps its text; backticks,
asterisks and escapes go), cut after `.`, `!` or `?` (and a closing quote or bracket) followed by a space. A sentence
of twenty words or more stands in one page only (of README.md and docs/*.md): no other page may hold it word for
word, nor with a few words changed (case and punctuation aside, difflib's ratio of the two word lists at least 0.6:
three words in five of the two sentences match, in order). Each topic has one home, and the other pages link to it.
"""

from __future__ import annotations

import re
from difflib import SequenceMatcher
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200  # a first page: nanoGPT's README is 234 lines, Accelerate's 277

LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")
EXTERNAL = ("http://", "https://", "mailto:")
SENTENCE_MIN_WORDS = 20  # a sentence this long stands in one page only
SIMILAR = 0.6  # difflib's ratio of two sentences' word lists at or above which one is a copy of the other
LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")
TABLE_ROW = re.compile(r"^\s*\|")
TABLE_RULE = re.compile(r"^[\s|:-]+$")
CELL_BORDER = re.compile(r"(?<!\\)\|")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[.!?][\"')\]])\s+")


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


def text_units(text: str) -> list[str]:
    """Paragraphs (runs of non-blank lines, joined), list items, headings and table cells, outside fenced code."""
    units: list[str] = []
    current: list[str] = []
    fenced = False

    def close() -> None:
        if current:
            units.append(" ".join(current))
            current.clear()

    for line in text.splitlines():
        stripped = line.strip()
        if FENCE.match(stripped):
            close()
            fenced = not fenced
        elif fenced:
            continue
        elif not stripped:
            close()
        elif TABLE_ROW.match(line):
            close()
            if not TABLE_RULE.match(stripped):
                units.extend(CELL_BORDER.split(stripped))
        elif match := HEADING.match(line):
            close()
            units.append(match.group(1))
        elif LIST_ITEM.match(line):
            close()
            current.append(LIST_ITEM.sub("", line, count=1))
        else:
            current.append(stripped)
    close()
    return units


def plain(text: str) -> str:
    """Markdown markup taken off: a link or image keeps its text; backticks, asterisks and escapes go."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"\\([\\`*_{}\[\]()#+.!|-])", r"\1", text)
    text = text.replace("`", "").replace("*", "")
    return " ".join(text.split())


def sentences(text: str) -> list[str]:
    return [part for unit in text_units(text) for part in SENTENCE_END.split(plain(unit)) if part]


def page_name(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def words(sentence: str) -> list[str]:
    """Lowercase words, the punctuation around them dropped."""
    return [w for w in (t.strip(".'-") for t in re.findall(r"[^\s,;:()\"!?]+", sentence.lower())) if w]


def same_sentence(first: list[str], second: list[str]) -> bool:
    """The same words in the same order, but for a few: SIMILAR of the two sentences' words match (1: a copy)."""
    matcher = SequenceMatcher(None, first, second, autojunk=False)
    return matcher.real_quick_ratio() >= SIMILAR and matcher.quick_ratio() >= SIMILAR and matcher.ratio() >= SIMILAR


def repeated_sentences(paths: list[Path]) -> list[tuple[str, str, str, str]]:
    """(page, sentence, other page, its copy) for each sentence of SENTENCE_MIN_WORDS words or more that another page
    holds too, word for word or nearly (`same_sentence`)."""
    long = [
        (page_name(path), sentence, tokens)
        for path in paths
        for sentence in sentences(path.read_text(encoding="utf-8"))
        if len(tokens := words(sentence)) >= SENTENCE_MIN_WORDS
    ]
    return [
        (page, sentence, other_page, other)
        for index, (page, sentence, tokens) in enumerate(long)
        for other_page, other, other_tokens in long[index + 1 :]
        if other_page != page and same_sentence(tokens, other_tokens)
    ]


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


def test_no_long_sentence_stands_in_two_pages():
    repeats = repeated_sentences(markdown_files())
    assert not repeats, (
        f"{len(repeats)} sentence(s) of {SENTENCE_MIN_WORDS} words or more stand in two pages; keep each in its "
        "topic's home page, and a short sentence with a link to it in the other:\n"
        + "\n".join(f"- {page}: {sentence}\n  {other_page}: {other}" for page, sentence, other_page, other in repeats)
    )


def test_repeated_sentences_are_found(tmp_path):
    """A copy is found through wrapping, markup, case and a few changed words; code, short sentences and sentences
    that only share some words are not copies."""
    copied = (
        "The loss scaler skips an overflowed step, the LR holds, and the alarm watches the skips in a row each time."
    )
    edited = (
        "A checkpoint that does not fit stops the run with exit code 4 and one line that names the path and the size."
    )
    in_code = (
        "every word of this line stands in both pages, but inside a fenced code block, so it is code and not prose"
    )
    short = "A short sentence of a few words, said in both of the two pages here."
    (tmp_path / "a.md").write_text(
        f"# A\n\nFirst. {copied[:45]}\n{copied[46:]} Last.\n\n{edited}\n\n```\n{in_code}\n```\n\n{short}\n\n"
        "The model and its tokenizer are saved at the end of the run, with a model card and the resolved config"
        " beside.\n",
        encoding="utf-8",
    )
    (tmp_path / "b.md").write_text(
        "# B\n\n- Before it. **The LOSS scaler** skips an [overflowed](a.md) step, the `LR` holds,\n"
        "  and the alarm watches the skips in a row each time!\n- Another item.\n\n"
        "| x | A write that does not fit stops the run with exit code 4 and one line: it names the path and the size"
        " |\n"
        f"|---|---|\n\n```\n{in_code}\n```\n\n{short}\n\n"
        "At the end of the run the weights go to the output folder, and the tokenizer, a card and the config go too.\n",
        encoding="utf-8",
    )
    found = repeated_sentences([tmp_path / "a.md", tmp_path / "b.md"])
    assert [(page, sentence, other_page) for page, sentence, other_page, _ in found] == [
        ("a.md", copied, "b.md"),
        ("a.md", edited, "b.md"),
    ]
