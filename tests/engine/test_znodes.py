"""Pure logic of node names and ordering (no server needed)."""

import re

import pytest

from celery_zklock.engine import znodes


def test_sequence_parsed_for_curator_and_kazoo_names():
    assert znodes.sequence_of("_c_abc-lock-0000000042") == 42
    assert znodes.sequence_of("3f2a__lock__0000000007") == 7
    assert znodes.sequence_of("leader-0000000001") is None
    assert znodes.sequence_of("_c_abc-lock-12") is None  # not a 10-digit sequence
    assert znodes.sequence_of("something-else") is None
    assert znodes.sequence_of("-lock-0000000001") == 1  # a bare marker still queues
    assert znodes.sequence_of("lock-0000000004") is None  # no marker
    assert znodes.sequence_of("abc-lock-00000000x1") is None
    assert znodes.sequence_of("abc-lock-٠٠٠٠٠٠٠٠٠١") is None  # digits, not ASCII


def test_contenders_sorted_numerically_across_kinds_and_others_ignored():
    children = [
        "_c_b-lock-0000000010",
        "zz__lock__0000000002",
        "unrelated",
        "_c_a-lock-0000000009",
        "lease-0000000001",
    ]
    assert znodes.sort_contenders(children) == [
        "zz__lock__0000000002",
        "_c_a-lock-0000000009",
        "_c_b-lock-0000000010",
    ]


def test_node_prefix_matches_curator_protected_name():
    assert znodes.node_prefix("abc") == "_c_abc-lock-"
    assert znodes.sequence_of(znodes.node_prefix("abc") + "0000000001") == 1


@pytest.mark.parametrize(
    "path, fragment",
    [
        ("locks/a", "absolute"),
        ("/", "absolute"),
        ("/a/", "end with"),
        ("/a//b", "empty component"),
        ("/a/../b", "'.' or '..'"),
        ("/a/\x00b", "U+0000"),
        (123, "must be a str"),
    ],
)
def test_invalid_paths_rejected_with_a_reason(path, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        znodes.validate_path(path)


def test_valid_paths_accepted():
    for p in ("/a", "/locks/sku:42", "/x/y-z_1/ünïcode"):
        assert znodes.validate_path(p) == p


@pytest.mark.parametrize(
    "name, seq",
    [
        ("_c_abc-lock--2147483648", -(2**31)),  # the first past the wrap: a sign and 10 digits
        ("_c_abc-lock--000000001", -1),  # a sign and 9 digits (Java's %010d, as Python's)
        ("_c_abc-lock--1000000000", -(10**9)),
        ("3f2a__lock__-000000007", -7),
        ("_c_abc-lock---00000001", None),
        ("_c_abc-lock-2147483648x", None),
        ("lock--000000001", None),  # no marker
        ("_c_abc-lock-00-0000001", None),
    ],
)
def test_sequences_past_the_wrap_are_parsed(name, seq):
    assert znodes.sequence_of(name) == seq


@pytest.mark.parametrize(
    "seqs",
    [
        [2**31 - 2, 2**31 - 1, -(2**31), -(2**31) + 1],  # the wrap at 2**31
        [-3, -2, -1, 0, 1],  # the wrap back to 0
        [5, 9, 10, 100],
        [-100, -10, -9],
    ],
)
def test_contenders_sorted_across_the_wrap(seqs):
    names = [f"_c_{i}-lock-{s:010d}" for i, s in enumerate(seqs)]
    assert znodes.sort_contenders(list(reversed(names))) == names
