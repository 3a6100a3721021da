import math

import pytest

from torchmem import b2mb, parse_size, readable_size


@pytest.mark.parametrize(
    ("num", "expected"),
    [(0, 0), (2**20 - 1, 0), (2**20, 1), (1.5 * 2**20, 1), (-1.5 * 2**20, -1), (2**30, 1024)],
)
def test_b2mb_truncates_toward_zero(num, expected):
    assert b2mb(num) == expected


@pytest.mark.parametrize(
    ("num", "expected"),
    [
        (0, "0.00B"),
        (512, "512.00B"),
        (1000, "1000.00B"),
        (1023.999, "1024.00B"),
        (1024, "1.00K"),
        (40 * 1024, "40.00K"),
        (1048575, "1024.00K"),
        (2097152, "2.00M"),
        (4198400, "4.00M"),
        (10.01 * 2**20, "10.01M"),
        (2**30, "1.00G"),
        (2**40, "1.00T"),
        (2**60, "1024.00P"),
        (-4194304, "-4.00M"),
        (-512, "-512.00B"),
    ],
)
def test_readable_size_matches_pytorch_memlab(num, expected):
    assert readable_size(num) == expected


def test_readable_size_of_nan_is_an_empty_cell():
    assert readable_size(math.nan) == ""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("4096B", 4096),
        ("4096 b", 4096),
        ("512k", 512 * 1024),
        ("500MB", 500 * 2**20),
        ("500 MiB", 500 * 2**20),
        ("500mb", 500 * 2**20),
        ("1.5 GiB", 1610612736),
        ("1.5GB", 1610612736),
        ("24G", 24 * 2**30),
        ("2T", 2 * 2**40),
        ("1P", 2**50),
        (".5K", 512),
        ("1e3", 1000),
        ("  7 M ", 7 * 2**20),
        ("0.1K", 102),  # 102.4 bytes round to the nearest byte
        (2**30, 2**30),
        (0, 0),
        (4096.0, 4096),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "MB",
        "-5MB",
        "5 XB",
        "1.5.2G",
        "5 MBs",
        "five",
        "nan",
        "inf",
        "12iB",  # a binary "i" needs its prefix
        "12 ib",
        "iB",
        "1e308P",  # finite alone, too large in bytes
        "1e300 PiB",
        "9e307K",
        -1,
        -1.0,
        1.5,
        math.nan,
        math.inf,
        True,
        None,
        [1],
        b"5MB",
    ],
)
def test_parse_size_rejects_bad_values_naming_them(bad):
    with pytest.raises(ValueError) as info:
        parse_size(bad)
    assert repr(bad) in str(info.value)


def test_the_largest_sizes_still_parse():
    assert parse_size("1e308") == int(1e308)
    assert parse_size("1e290P") == round(1e290 * 2**50)
