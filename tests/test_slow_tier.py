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
