"""README.md is a guide a newcomer reads: short, a first screen nearly free of figures, plain sentences, nothing it
points to outside the repository, and a map of the package that matches the tree.

**Figures** (`figures`): a figure is a number the reader has to take in, a measurement, a result or a setting: a run
of digits, with `.` or `,` between digit groups, that stands on its own, which the regex `FIGURE` reads as not glued
on its left to a letter, a digit, `_`, `-`, `.`, `/`, `#` or `~`. So "1.53x", "tau 2.76", "27 minutes", "135M",
"--ngram 4" and "torch==2.13.0" are one figure each, and the digits inside a name are none: "SmolLM2",
"smollm2-135m-adapt.yaml", "bf16", "AVX-512", "Qwen3-8B", a heading's anchor. An ordered list's "1." is no figure.
Numbers are counted outside code spans and inside them alike (inline code and fenced blocks): a command-line value or
a version pin on the first screen is as much to take in as a measurement. A range ("1.23-1.26x") counts once, and
written-out numbers ("two cores") not at all; keep those few too.

**Sentences** (`sentences`): prose only, outside fenced code blocks and tables. Each heading, paragraph and list item
is read on its own and split after `.`, `!` or `?` followed by white space; a word is a run of non-space characters,
a link counted by its text only. A split after an abbreviation ("e.g.") only shortens what is measured.

**Outside the repository** (`outside_links`): every Markdown link is a path in the repository to a file that exists
(and, with `#anchor` into a Markdown file, to one of its headings): no URL, no `../`. No path in the text starts with
`../`, `~/` or `/` (an absolute path has two parts or more, `/x/y`), so nothing names a machine's folders.

Two more checks keep it true: the install and test commands `.ci/run` runs appear as README's commands, and the map
of the package (the code block under "## Map of the package") names every module and subpackage at the package's
root and every stage, and nothing that does not exist.
"""

from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO_ROOT

README = REPO_ROOT / "README.md"
PACKAGE = REPO_ROOT / "dflash_train"
MAX_LINES = 330  # 320 until the refresh section (issue 61): a guide, not a log
FIRST_SCREEN_LINES = 40
MAX_FIRST_SCREEN_FIGURES = 10
MAX_SENTENCE_WORDS = 60

FIGURE = re.compile(r"(?<![\w\-./#~])\d+(?:[.,]\d+)*")
LIST_MARKER = re.compile(r"^\s*\d+\.\s")
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]*)\)")
PATH_OUTSIDE = re.compile(r"(?:^|(?<=[\s`'\"(\[=:]))((?:\.\./|~/|/[\w.-]+/)[^\s`'\")\],;]*)", re.M)
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def figures(text: str) -> list[str]:
    """The figures of `text`, in order (see the module's docstring)."""
    return [m.group() for line in text.splitlines() for m in FIGURE.finditer(LIST_MARKER.sub("", line))]


def prose_units(text: str) -> list[str]:
    """Headings, paragraphs and list items outside fenced code and tables, each as one line of text."""
    units: list[list[str]] = []
    fenced = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            fenced = not fenced
            units.append([])
            continue
        if fenced or not stripped or stripped.startswith("|"):
            units.append([])
            continue
        if stripped.startswith(("#", "- ", "* ")) or LIST_MARKER.match(line) or not units:
            units.append([])
            stripped = LIST_MARKER.sub("", stripped.removeprefix("- ").removeprefix("* "))
        if stripped.startswith("#"):
            units[-1].append(stripped.lstrip("#").strip())
            units.append([])
        else:
            units[-1].append(stripped)
    return [" ".join(u) for u in units if u]


def sentences(text: str) -> list[str]:
    """The prose's sentences, links read as their text."""
    return [s for unit in prose_units(text) for s in SENTENCE_END.split(LINK.sub(r"\1", unit)) if s.strip()]


def anchors(markdown: str) -> set[str]:
    """The heading anchors GitHub writes: lower case, punctuation but `-` and `_` dropped, spaces as `-`."""
    found = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def outside_links(text: str, base: Path = REPO_ROOT) -> list[str]:
    """Each link or path of `text` that points outside the repository or at nothing in it, with why."""
    problems = []
    for _, target in LINK.findall(text):
        path, _, anchor = target.partition("#")
        if re.match(r"[a-z][a-z+.-]*:", path):
            problems.append(f"{target}: a URL, outside the repository")
            continue
        file = (base / path).resolve() if path else README
        if path and not file.is_relative_to(base.resolve()):
            problems.append(f"{target}: outside the repository")
        elif not file.exists():
            problems.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            problems.append(f"{target}: no heading #{anchor} in {file.name}")
    for path in PATH_OUTSIDE.findall(LINK.sub(r"\1", text)):
        problems.append(f"{path}: a path outside the repository")
    return problems


def package_map(text: str) -> list[str]:
    """The map of the package (the code block under "## Map of the package"): every path it names, relative to the
    repository root (a folder with its trailing `/`)."""
    section = text.split("## Map of the package", 1)[1]
    block = section.split("```", 2)[1].splitlines()[1:]
    named = []
    for line in block:
        indent = len(line) - len(line.lstrip())
        head = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        if not head or head.startswith("-") or indent > 2:
            continue
        prefix = "dflash_train/" if indent == 2 else ""
        named += [prefix + name.strip() for name in head.split(",") if name.strip() != "dflash_train/"]
    return named


def package_entries() -> set[str]:
    """What the map has to name: each module and subpackage at the package's root, each stage's package."""
    entries = set()
    for path in PACKAGE.iterdir():
        if path.suffix == ".py" and path.stem not in ("__init__", "__main__"):
            entries.add(f"dflash_train/{path.name}")
        elif path.is_dir() and (path / "__init__.py").exists() and path.name != "stages":
            entries.add(f"dflash_train/{path.name}/")
    for stage in (PACKAGE / "stages").iterdir():
        if (stage / "__init__.py").exists():
            entries.add(f"dflash_train/stages/{stage.name}/")
    return entries


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines, at most {MAX_LINES}"


def test_readme_first_screen_is_nearly_free_of_figures():
    first = "\n".join(README.read_text().splitlines()[:FIRST_SCREEN_LINES])
    found = figures(first)
    assert len(found) <= MAX_FIRST_SCREEN_FIGURES, (
        f"README.md's first {FIRST_SCREEN_LINES} lines state {len(found)} figures, at most "
        f"{MAX_FIRST_SCREEN_FIGURES}: {found}")


def test_readme_sentences_are_short():
    long = [(len(s.split()), s) for s in sentences(README.read_text()) if len(s.split()) > MAX_SENTENCE_WORDS]
    assert not long, "\n".join(f"{n} words: {s}" for n, s in long)


def test_readme_points_inside_the_repository_only():
    assert not outside_links(README.read_text())


def test_readme_names_the_commands_ci_runs():
    blocks = "\n".join(README.read_text().split("```")[1::2])
    ci = [line.strip() for line in (REPO_ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("make ")]
    assert ci and all(re.search(rf"^{re.escape(c)}(\s|$)", blocks, re.M) for c in ci), ci


def test_readme_map_matches_the_package():
    named = package_map(README.read_text())
    assert [n for n in named if not (REPO_ROOT / n).exists()] == []
    assert {n for n in named if n.startswith("dflash_train/")} == package_entries()


def test_the_checks_read_what_they_say():
    """The definitions above, on examples (the docstring's)."""
    assert figures("1.53x, tau 2.76, 27 minutes, a 135M target, --ngram 4, torch==2.13.0") == [
        "1.53", "2.76", "27", "135", "4", "2.13.0"]
    assert figures("1. SmolLM2 smollm2-135m-adapt.yaml bf16 AVX-512 Qwen3-8B [x](#vllms-k--1-drafts) x86_64") == []
    assert sentences("# A title\n\nOne two. Three\nfour [five](x.md)!\n\n- six\n- seven e.g. eight\n\n| a. b |\n"
                     "```\nnine. ten\n```\n") == ["A title", "One two.", "Three four five!", "six", "seven e.g.",
                                                  "eight"]
    assert outside_links("[a](../shared/x.md) [b](https://example.com) see /work/main/x or ~/.cache, not "
                         "tokens/s [c](README.md#nothing-here)") == [
        "../shared/x.md: outside the repository", "https://example.com: a URL, outside the repository",
        "README.md#nothing-here: no heading #nothing-here in README.md",
        "/work/main/x: a path outside the repository", "~/.cache: a path outside the repository"]
