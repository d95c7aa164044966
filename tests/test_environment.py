"""``posterior_fusion/environment.py``: every environment variable declared once and read through one function,
with the same conversion and checks as every other setting."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from posterior_fusion.environment import Environment, environment
from posterior_fusion.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_unset_or_empty_variables_take_their_declared_defaults(monkeypatch):
    for f in dataclasses.fields(Environment):
        monkeypatch.delenv(f.name, raising=False)
        assert environment(f.name) == f.default
        monkeypatch.setenv(f.name, "  ")
        assert environment(f.name) == f.default


@pytest.mark.parametrize("name, text, value", [("PFUSE_PROGRESS", "0", False), ("PFUSE_PROGRESS", "yes", True),
                                               ("PFUSE_MALLOC", "DEFAULT", "default"), ("PFUSE_KERNEL", "triton", "triton"),
                                               ("PFUSE_MAX_MEMORY", "8G", "8G")])
def test_a_set_variable_is_converted_as_its_declaration_says(monkeypatch, name, text, value):
    monkeypatch.setenv(name, text)
    assert environment(name) == value


@pytest.mark.parametrize("name, text", [("PFUSE_PROGRESS", "2"), ("PFUSE_PROGRESS", "off!"), ("PFUSE_MALLOC", "none"),
                                        ("PFUSE_KERNEL", "cuda")])
def test_a_bad_value_is_one_line_naming_the_variable(monkeypatch, name, text):
    monkeypatch.setenv(name, text)
    with pytest.raises(ConfigError, match=re.escape(name)) as err:
        environment(name)
    assert "\n" not in str(err.value)


def test_the_memory_budget_and_the_progress_display_read_their_variables(monkeypatch):
    from posterior_fusion import budget, progress

    monkeypatch.setenv("PFUSE_MAX_MEMORY", "3M")
    assert budget.default_limit() == 3 * 2**20
    monkeypatch.setenv("PFUSE_PROGRESS", "0")
    assert progress.enabled() is False


def test_no_module_reads_a_pfuse_variable_but_this_one_and_every_one_named_is_declared():
    """A read (``os.environ.get("PFUSE_…")``, ``os.environ["PFUSE_…"]`` not assigned) outside
    ``environment.py`` is an inline default; a ``PFUSE_`` name in the package or its docs that is not declared is
    a variable nobody reads."""
    declared = {f.name for f in dataclasses.fields(Environment)}
    read = re.compile(r"environ(\.get\(|\[)\"(PFUSE_[A-Z_]+)\"")
    readers, named = [], set()
    for path in [*(ROOT / "posterior_fusion").rglob("*.py"), *(ROOT / "cli").rglob("*.py")]:
        text = path.read_text()
        if path.name != "environment.py":
            readers += [f"{path.relative_to(ROOT)}: {m.group(2)}" for m in read.finditer(text)
                        if m.group(1) == ".get(" or not re.match(r"\]\s*=[^=]", text[m.end():])]
        named |= set(re.findall(r"PFUSE_[A-Z][A-Z_]*[A-Z]", text))
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        named |= set(re.findall(r"PFUSE_[A-Z][A-Z_]*[A-Z]", path.read_text()))
    assert not readers, readers
    assert named <= declared, named - declared
    assert {"PFUSE_PROGRESS", "PFUSE_MAX_MEMORY"} <= named  # the scan sees the names
