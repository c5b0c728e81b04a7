"""The CPU platform's share of cores per rank under --tp / --dp (`sglang_plugin.cpu.ranks`); the
servers that run on it are in test_sglang_tp.py."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")

from jetflow_sglang.sglang_plugin.cpu.ranks import parse_cores, split_cores  # noqa: E402


def test_cores_split_in_equal_shares_in_order():
    assert split_cores([0, 1], 2) == [[0], [1]]
    assert split_cores([4, 5, 6, 7, 8], 2) == [[4, 5], [6, 7]]  # one left over: every rank runs as many threads
    assert split_cores([0, 1, 2, 3], 1) == [[0, 1, 2, 3]]
    assert split_cores([0, 1], 3) == [[0], [1], [0]]  # more ranks than cores: one thread each, cores shared


def test_core_lists_parse_as_sglang_writes_them():
    assert parse_cores("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cores("5") == [5]
    with pytest.raises(ValueError, match="no CPU cores"):
        parse_cores(",")
