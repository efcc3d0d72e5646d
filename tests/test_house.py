"""The house rules that keep meshrun's structure readable (docs/design.md §1).

- The layers import one way: launcher -> agent -> rendezvous. agent/ and rendezvous/ never
  import launcher/, rendezvous/ never imports agent/, and parallel/ (the worker-side library)
  imports none of launcher/, agent/ or rendezvous/ (and they import nothing from parallel/).
- Every "docs/design.md §N" in the code, the tests and the docs names a section that exists.

Imports are read from the syntax tree, so imports inside functions count too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "meshrun"

#: layer -> the layers it must never import
FORBIDDEN = {
    "agent": {"launcher", "parallel"},
    "rendezvous": {"launcher", "agent", "parallel"},
    "parallel": {"launcher", "agent", "rendezvous"},
    "launcher": {"parallel"},
}


def imported_layers(path: Path) -> dict[str, int]:
    """The meshrun layers (``meshrun.<layer>``) ``path`` imports, each with its first line."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "meshrun" and len(parts) > 1:
                found.setdefault(parts[1], node.lineno)
    return found


def violations(root: Path = PACKAGE) -> list[str]:
    out = []
    for layer, banned in FORBIDDEN.items():
        for path in sorted((root / layer).rglob("*.py")):
            for imported, line in imported_layers(path).items():
                if imported in banned:
                    out.append(f"{path.relative_to(root.parent)}:{line} imports meshrun.{imported}")
    return out


@pytest.mark.timeout(60)
def test_the_layers_import_one_way():
    assert violations() == []


@pytest.mark.timeout(60)
def test_the_layer_rule_catches_an_upward_import(tmp_path):
    """The check itself can fail: a planted upward import (inside a function) is found."""
    for layer in FORBIDDEN:
        (tmp_path / "meshrun" / layer).mkdir(parents=True)
    bad = tmp_path / "meshrun" / "parallel" / "bad.py"
    bad.write_text("def f():\n    from meshrun.agent.errors import WorkerFailure\n")
    (tmp_path / "meshrun" / "rendezvous" / "bad.py").write_text("import meshrun.launcher.cli\n")
    (tmp_path / "meshrun" / "agent" / "ok.py").write_text("from meshrun import rendezvous\n")
    assert sorted(violations(tmp_path / "meshrun")) == [
        "meshrun/parallel/bad.py:2 imports meshrun.agent",
        "meshrun/rendezvous/bad.py:1 imports meshrun.launcher",
    ]


DESIGN = ROOT / "docs" / "design.md"
_REFERENCE = re.compile(r"docs/design\.md\s+((?:§\s?[0-9]+(?:\.[0-9]+)*(?:,\s*)?)+)")
_SECTION = re.compile(r"§\s?([0-9]+(?:\.[0-9]+)*)")
_HEADING = re.compile(r"^#{2,4}\s+([0-9]+(?:\.[0-9]+)*)\.?\s", re.M)


def design_sections(text: str) -> set[str]:
    """The numbers of docs/design.md's numbered headings ("## 3. Contracts" -> "3")."""
    return set(_HEADING.findall(text))


def design_references(root: Path = ROOT) -> list[tuple[str, str]]:
    """(where, section) for every "docs/design.md §N[, §M]" in meshrun/, tests/, docs/,
    benchmarks/, examples/ and the README."""
    files = [root / "README.md"]
    for folder in ("meshrun", "tests", "docs", "benchmarks", "examples"):
        files += [p for p in (root / folder).rglob("*") if p.suffix in (".py", ".md", ".sh")]
    refs = []
    for path in files:
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        for m in _REFERENCE.finditer(text):
            line = text[: m.start()].count("\n") + 1
            for section in _SECTION.findall(m.group(1)):
                refs.append((f"{path.relative_to(root)}:{line}", section))
    return refs


@pytest.mark.timeout(60)
def test_every_design_reference_names_a_section():
    sections = design_sections(DESIGN.read_text())
    here = str(Path(__file__).relative_to(ROOT))  # its planted examples are not references
    refs = [(where, s) for where, s in design_references() if not where.startswith(here)]
    assert refs, "no code cites docs/design.md: the reference scan is broken"
    missing = [f"{where} cites §{s}" for where, s in refs if s not in sections]
    assert missing == [], f"docs/design.md has sections {sorted(sections)}"


@pytest.mark.timeout(60)
def test_the_design_check_catches_a_missing_section(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "meshrun").mkdir()
    (tmp_path / "README.md").write_text("see docs/design.md §3.4 and docs/design.md §9\n")
    (tmp_path / "meshrun" / "m.py").write_text('"""x (docs/design.md §3.1, §3.7)."""\n')
    refs = sorted(s for _, s in design_references(tmp_path))
    assert refs == ["3.1", "3.4", "3.7", "9"]
    sections = design_sections("# t\n## 3. Contracts\n### 3.1 Worker env\n### 3.4 Exit codes\n")
    assert sorted(s for s in refs if s not in sections) == ["3.7", "9"]


@pytest.mark.timeout(60)
def test_no_reference_to_the_old_outside_design_page():
    """The design lives in docs/design.md; "docs/design.md §N" pointed at a page outside the tree."""
    old = re.compile(r"(?<![/\w])DESIGN(?:\.md)? §")
    hits = []
    for folder in ("meshrun", "tests", "docs", "benchmarks", "examples"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".md") and path.is_file() and path != Path(__file__):
                text = path.read_text(errors="replace")
                hits += [f"{path.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}"
                         for m in old.finditer(text)]  # fmt: skip
    assert hits == []
