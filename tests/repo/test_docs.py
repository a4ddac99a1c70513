"""Tests that guard the documentation: every document, section or path the code and the docs cite exists, and
nothing cites the contract files the repository does not carry (its math and data layouts are in docs/)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".sh", ".toml"}
# A cited repository path: docs and reports (with an optional #anchor), or a source file.
CITATION = re.compile(
    r"(?<![\w/.-])((?:docs|bench|mega_suite|kernels|datamodules|tests|recipes|corpora)/[\w./-]*\w\.(?:md|py|yaml|sh))"
    r"(#[\w-]+)?"
)
MODULE_COMMAND = re.compile(r"python -m ((?:bench|mega_suite|corpora)(?:\.\w+)+)")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s#]*)(#[\w-]*)?\)")
FORBIDDEN = {
    r"SPEC ?§|SPEC\.md": "the contract's sections are cited as docs/architecture.md#... or docs/recipes.md#...",
    r"(?<!docs/)(?<![\w/])DATA\.md": "data layouts are cited as docs/data.md#...",
    r"RESULTS\.md ?§": "results are cited by report file (bench/reports/...), not by section number",
    r"\.\./shared": "the repository cites only itself",
}


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    files = [ROOT / f for f in out.split() if Path(f).suffix in TEXT_SUFFIXES or f == "Makefile"]
    return [f for f in files if f != Path(__file__).resolve()]  # its own planted mistakes


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # headings, not code comments
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)}


def broken_citations(files: list[Path]) -> list[str]:
    bad = []
    for path in files:
        text = path.read_text()
        rel = path.relative_to(ROOT)
        found = [(m.group(1), m.group(2), ROOT) for m in CITATION.finditer(text)]
        if path.suffix == ".md":  # relative links resolve against the page's folder
            found += [(m.group(1), m.group(2), path.parent) for m in MARKDOWN_LINK.finditer(text)
                      if m.group(1) and "://" not in m.group(1) and not m.group(1).startswith("mailto:")]  # fmt: skip
            found += [
                ("", m.group(2), path) for m in MARKDOWN_LINK.finditer(text) if not m.group(1) and m.group(2)
            ]
        history = rel.parts[:2] == ("bench", "reports")  # dated reports name the code as it was then
        for m in MODULE_COMMAND.finditer(text if not history else ""):
            module = ROOT.joinpath(*m.group(1).split("."))
            if not (module.with_suffix(".py").exists() or (module / "__main__.py").exists()):
                bad.append(f"{rel}: runs python -m {m.group(1)}, which does not exist")
        for target, anchor, base in found:
            if history and target.endswith((".py", ".yaml", ".sh")):
                continue
            where = base if not target else (base / target).resolve()
            if target and not where.exists():
                bad.append(f"{rel}: cites {target}, which does not exist")
            elif anchor and where.suffix == ".md" and anchor[1:] not in anchors(where):
                bad.append(f"{rel}: cites {target}{anchor}, a section {where.name} does not have")
    return bad


def test_every_cited_document_section_and_path_exists():
    bad = broken_citations(tracked_text_files())
    assert not bad, "\n".join(bad)


def test_nothing_cites_documents_the_repository_lacks():
    bad = []
    for path in tracked_text_files():
        if path.is_relative_to(ROOT / "bench" / "reports"):
            continue  # dated reports quote the history as it was written
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for pattern, fix in FORBIDDEN.items():
                if re.search(pattern, line):
                    bad.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()[:80]} ({fix})")
    assert not bad, "\n".join(bad)


def test_the_checks_catch_planted_mistakes(tmp_path, monkeypatch):
    page = ROOT / "docs" / "architecture.md"
    assert "cema" in anchors(page) and slug("Float32 islands") == "float32-islands"
    planted = tmp_path / "planted.py"
    planted.write_text(
        "# see docs/architecture.md#no-such-section and docs/nowhere.md and docs/architecture.md#cema\n"
        "# python -m bench.nothing_here\n"
    )
    monkeypatch.setattr("test_docs.ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "architecture.md").write_text(page.read_text())
    bad = broken_citations([planted])
    assert len(bad) == 3, bad
    assert "bench.nothing_here" in bad[0] and "no-such-section" in bad[1] and "nowhere.md" in bad[2]
