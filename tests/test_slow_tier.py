"""tests/slow_tier.py names only tests that exist: a stale entry would mark nothing and say nothing."""

import pathlib
import re

import slow_tier

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_slow_file_and_function_exists():
    for path in slow_tier.SLOW_FILES | set(slow_tier.SLOW_TESTS):
        assert (ROOT / path).is_file(), f"{path} is in tests/slow_tier.py but does not exist: drop it there"
    for path, functions in slow_tier.SLOW_TESTS.items():
        defined = set(re.findall(r"^def (test_\w+)\(", (ROOT / path).read_text(), flags=re.MULTILINE))
        missing = sorted({name.removesuffix('[*]') for name in functions} - defined)
        assert not missing, f"{path} has no {missing}: drop them from tests/slow_tier.py"
    assert not slow_tier.SLOW_FILES & set(slow_tier.SLOW_TESTS), "a file is listed whole and by function"


class _Item:
    """The parts of a pytest item that slow_tier.mark reads."""

    def __init__(self, nodeid, parametrized):
        self.nodeid, self.markers = nodeid, []
        if parametrized:
            self.callspec = object()

    def add_marker(self, marker):
        self.markers.append(marker.name)


def test_marking_keeps_a_listed_functions_first_case_unless_starred(monkeypatch):
    monkeypatch.setattr(slow_tier, "SLOW_FILES", {"tests/test_whole.py"})
    monkeypatch.setattr(slow_tier, "SLOW_TESTS", {"tests/test_x.py": {"test_cases", "test_plain", "test_all[*]"}})
    items = {name: _Item(name, "[" in name) for name in [
        "tests/test_whole.py::test_any", "tests/test_x.py::test_cases[a]", "tests/test_x.py::test_cases[b]",
        "tests/test_x.py::test_plain", "tests/test_x.py::test_all[a]", "tests/test_x.py::test_all[b]",
        "tests/test_x.py::test_other[a]"]}
    slow_tier.mark(list(items.values()))
    slow = {name for name, item in items.items() if item.markers == ["slow"]}
    assert slow == {"tests/test_whole.py::test_any", "tests/test_x.py::test_cases[b]", "tests/test_x.py::test_plain",
                    "tests/test_x.py::test_all[a]", "tests/test_x.py::test_all[b]"}
