"""The error tree: one exit code per branch, documented in docs/exit-codes.md."""

from __future__ import annotations

import re
from pathlib import Path

import fedsplit.server.admin.errors  # noqa: F401  (defines the admin branch's subclasses)
from fedsplit.protocol.errors import (
    AggregationError,
    ConfigError,
    FedsplitError,
    ResumeMismatchError,
    exit_codes,
)

from fedsplit import aggregation

EXIT_CODES = Path(__file__).resolve().parents[2] / "docs" / "exit-codes.md"


def _branches() -> list[type[FedsplitError]]:
    return [FedsplitError, *FedsplitError.__subclasses__()]


def test_every_branch_has_its_own_exit_code() -> None:
    """No two direct branches share a code; subclasses keep their branch's code."""
    codes = [cls.exit_code for cls in _branches()]
    assert len(codes) == len(set(codes)), codes
    for branch in FedsplitError.__subclasses__():
        todo = list(branch.__subclasses__())
        while todo:
            sub = todo.pop()
            assert sub.exit_code == branch.exit_code, (sub, branch)
            todo.extend(sub.__subclasses__())
    assert ResumeMismatchError.exit_code == ConfigError.exit_code == 2
    assert aggregation.UnknownStrategyError.exit_code == AggregationError.exit_code


def test_readme_exit_code_table_matches_the_tree() -> None:
    """docs/exit-codes.md's table lists exactly the codes the tree defines, with their class names."""
    section = EXIT_CODES.read_text()
    rows = dict(re.findall(r"^\| (\d+) \| `(\w+)` \|", section, flags=re.MULTILINE))
    assert {int(k): v for k, v in rows.items()} == exit_codes()
