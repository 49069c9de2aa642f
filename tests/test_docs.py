"""The documentation checked like code: every relative link and anchor in README.md,
ARCHITECTURE.md and docs/*.md resolves; every module docstring keeps ARCHITECTURE.md's rule (at
most 15 lines, its longer notes in docs/ behind a ``Design notes:`` link that resolves); the
README stays a front page whose set-up commands are what .ci/run runs and whose figures stand in
docs/BENCHMARKS.md."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", ROOT / "ARCHITECTURE.md", *(ROOT / "docs").glob("*.md")])
MODULES = sorted((ROOT / "autosymm").rglob("*.py"))
#: ARCHITECTURE.md's "Module essays": a module docstring is at most about 15 lines.
MAX_DOCSTRING_LINES = 15
#: The README is a front page, not a reference (the reference is in docs/).
MAX_README_LINES = 200

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
_ANCHOR_ID = re.compile(r"""<a\s+(?:name|id)=["']([^"']+)["']""")
_DESIGN_NOTES = re.compile(r"Design notes:\s*(docs/[A-Z_]+\.md)(?:#([\w-]+))?")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans (no links live there)."""
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text (markup and link targets dropped) lower-cased,
    every character but letters, digits, '_', '-' and spaces dropped, spaces made '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor of a markdown file: explicit ``<a id>`` ones and its headings' slugs
    (a repeated slug gets -1, -2, ... as on GitHub)."""
    text = _FENCE.sub("", path.read_text())
    found = set(_ANCHOR_ID.findall(text))
    seen: dict[str, int] = {}
    for heading in _HEADING.findall(text):
        slug = github_slug(heading)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def _links(path: Path) -> list[str]:
    return _LINK.findall(_prose(path.read_text()))


def _broken(path: Path, target: str) -> str:
    """'' when ``target`` (a link in ``path``) resolves, else why not."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:: not ours to check
        return ""
    where, _, anchor = target.partition("#")
    dest = (path.parent / where).resolve() if where else path
    shown = dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest
    if not dest.exists():
        return f"{target}: no file {shown}"
    if anchor:
        if dest.suffix != ".md":
            return f"{target}: an anchor into a file that is not markdown"
        if anchor not in anchors(dest):
            return f"{target}: no anchor #{anchor} in {shown}"
    return ""


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(doc):
    broken = [why for target in _links(doc) if (why := _broken(doc, target))]
    assert not broken, f"{doc.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


def test_the_link_checker_finds_a_broken_link_and_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Title: `x.py`, with 2 parts\n\n## Same\n\n## Same\n\n<a id=\"kept\"></a>\n")
    (tmp_path / "b.md").write_text(
        "[ok](a.md#title-xpy-with-2-parts) [ok](a.md#same-1) [ok](a.md#kept) [ok](#local) [web](https://x.org/#y)\n"
        "[gone](c.md) [bad](a.md#nowhere) `[code](c.md)`\n\n## Local\n\n```\n[fenced](c.md)\n```\n")
    doc = tmp_path / "b.md"
    assert [t for t in _links(doc) if _broken(doc, t)] == ["c.md", "a.md#nowhere"]


def _docstring(module: Path) -> str | None:
    return ast.get_docstring(ast.parse(module.read_text()), clean=True)


@pytest.mark.parametrize("module", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_docstring_keeps_the_15_line_rule(module):
    doc = _docstring(module)
    assert doc, f"{module.relative_to(ROOT)} has no module docstring"
    lines = doc.strip().splitlines()
    assert len(lines) <= MAX_DOCSTRING_LINES, (
        f"{module.relative_to(ROOT)}: a {len(lines)}-line module docstring (ARCHITECTURE.md: at most about "
        f"{MAX_DOCSTRING_LINES}); move the longer notes to docs/ and end with 'Design notes: docs/<FILE>.md#<section>'")
    for file, anchor in _DESIGN_NOTES.findall(doc):
        target = ROOT / file
        assert target.exists(), f"{module.relative_to(ROOT)}: Design notes point to {file}, which does not exist"
        assert not anchor or anchor in anchors(target), f"{module.relative_to(ROOT)}: no #{anchor} in {file}"


def test_every_module_section_in_the_docs_is_pointed_to_by_its_module():
    """A docs section titled with a module's path (``<a id>`` then the path as its heading) is that
    module's design notes: the module exists and its docstring links to that section."""
    section = re.compile(r'<a id="([\w-]+)"></a>\n#+ `(autosymm/[\w/]+\.py)`')
    pairs = [(doc, anchor, path) for doc in DOCS for anchor, path in section.findall(doc.read_text())]
    assert len(pairs) >= 20
    for doc, anchor, path in pairs:
        module = ROOT / path
        assert module.exists(), f"{doc.relative_to(ROOT)} has notes of {path}, which does not exist"
        wanted = f"{doc.relative_to(ROOT)}#{anchor}"
        assert f"Design notes: {wanted}" in (_docstring(module) or ""), f"{path}'s docstring does not point to {wanted}"


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; the reference belongs in docs/"


def test_the_readme_set_up_is_what_ci_runs():
    """The README's two commands: the installs .ci/run makes (torch, then the package with its
    test extras) and the test command .ci/run calls."""
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    torch_pin = re.search(r"pip install -q (torch==\S+)", ci).group(1)
    assert f"python3 -m pip install {torch_pin} && python3 -m pip install -e \".[test]\"" in readme
    assert 'pip install -q -e ".[test]"' in ci
    assert "\npython3 -m pytest -q\n" in ci and "\npython3 -m pytest -q\n" in readme


#: A measured figure: a number or a range, then a unit of time, bandwidth, ratio or share ("2x H200"
#: is hardware, not a ratio).
_FIGURE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(?:\s?-\s?(\d+(?:\.\d+)?))?\s?(us|µs|ms|s|GB/s|x|%)(?![\w/])(?! H\d)")


def _numbers(text: str) -> set[float]:
    return {float(n) for n in re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?![\d])", text)}


def test_the_readme_figures_stand_in_benchmarks():
    """Every measured figure on the front page (a time, a bandwidth, a ratio, a percentage) is a
    number docs/BENCHMARKS.md gives, where its date, hardware and command are."""
    measured = _numbers((ROOT / "docs" / "BENCHMARKS.md").read_text())
    readme = (ROOT / "README.md").read_text()
    figures = [(m.group(0), n) for m in _FIGURE.finditer(_prose(readme)) for n in m.groups()[:2] if n is not None]
    assert len(figures) >= 10
    missing = [text for text, number in figures if float(number) not in measured]
    assert not missing, f"README figures not in docs/BENCHMARKS.md: {missing}"
