"""parse_size: every accepted form, and every rejected one with a message that helps."""
import pytest

from remat.planner.job.budget import format_size, parse_size

GOOD = [
    ("60GB", 60 * 10**9), ("60GiB", 60 * 2**30), ("60gb", 60 * 10**9), ("60 GiB", 60 * 2**30),
    ("1.5GB", 1_500_000_000), ("1.5 gib", 3 * 2**29), (".5GB", 500_000_000),
    ("512MB", 512 * 10**6), ("512MiB", 512 * 2**20), ("64KB", 64_000), ("64kib", 65_536),
    ("1000B", 1000), ("1000b", 1000), ("1000", 1000), (" 2 GIB ", 2 * 2**30), ("1e3MB", 10**9),
    ("2TB", 2 * 10**12), (123, 123), (80 * 10**9, 80 * 10**9),
    ("1.0000000001KB", 1000),  # a fraction of a byte rounds down: a budget is a capacity
]


@pytest.mark.parametrize("text, expected", GOOD)
def test_accepted(text, expected):
    assert parse_size(text) == expected
    assert isinstance(parse_size(text), int)


BAD = [
    ("0GB", "zero"), (0, "zero"), ("-1GB", "negative"), (-5, "negative"),
    ("inf GB", "not finite"), ("nan", "not finite"), ("-infGB", "not finite"),
    (True, "cannot read"), (False, "cannot read"), (None, "cannot read"), ("", "cannot read"),
    ("GB", "cannot read"), ("1..5GB", "cannot read"), ("abc", "cannot read"),
    ("1.5XB", "unknown unit"), ("60 G B", "cannot read"), ("0.1B", "less than one byte"),
]


@pytest.mark.parametrize("value, why", BAD)
def test_rejected_quotes_input_and_accepted_forms(value, why):
    with pytest.raises(ValueError) as info:
        parse_size(value)
    message = str(info.value)
    assert why in message
    assert repr(value) in message
    assert '"60GB"' in message and "GiB" in message  # the accepted forms


@pytest.mark.parametrize("value", [60e9, 1.5, float("inf"), float("nan")])
def test_a_float_is_refused_saying_why(value):
    with pytest.raises(ValueError) as info:
        parse_size(value)
    message = str(info.value)
    assert repr(value) in message and "is a float" in message
    assert "give an int of bytes or a string like '60GB'" in message


@pytest.mark.parametrize("value", ["1e30", "1e19", 10**19, 2**63, "9.3e18B"])
def test_sizes_of_2_to_the_63_bytes_and_more_are_refused(value):
    with pytest.raises(ValueError, match=r"not below 2\*\*63 .*64-bit integers"):
        parse_size(value)
    assert parse_size(2**63 - 1) == 2**63 - 1  # the largest that fits an int64


def test_zero_allowed_where_asked():
    assert parse_size(0, allow_zero=True) == 0
    assert parse_size("0GB", allow_zero=True) == 0
    with pytest.raises(ValueError, match="negative"):
        parse_size("-1", allow_zero=True)


def test_format_size():
    assert format_size(107_273_519_104) == "107.27 GB"
    assert format_size(1_500_000) == "1.50 MB"
    assert format_size(999) == "999 B"
    assert format_size(-2_000_000_000) == "-2.00 GB"
