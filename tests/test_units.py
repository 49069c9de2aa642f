"""Sizes as text (autosymm.units): SI units decimal, IEC units binary, labels read back exactly."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autosymm.problem import format_bytes, parse_bytes
from autosymm.units import BINARY_UNITS, DECIMAL_UNITS, MAX_SIZE, format_size, parse_size


@pytest.mark.parametrize("text, nbytes", [
    ("3MB", 3_000_000), ("100kB", 100_000), ("1GB", 10**9), ("2TB", 2 * 10**12), ("3MiB", 3 << 20),
    ("16KiB", 16384), ("1.5MiB", 1572864), ("1TiB", 1 << 40), ("64GiB", 64 << 30), ("4096", 4096), ("0", 0),
    (" 4 kib ", 4096), ("100KB", 100_000), ("1e6", 10**6), ("1.5e3kB", 1_500_000), ("12B", 12), (".5KiB", 512)])
def test_parse_size_reads_si_as_decimal_and_iec_as_binary(text, nbytes):
    assert parse_size(text) == nbytes == parse_bytes(text)


@pytest.mark.parametrize("text, message", [
    ("16K", r"ambiguous: write 16KiB \(2\^10 bytes each\) or 16kB \(10\^3 bytes each\)"),
    ("3m", "ambiguous: write 3MiB"), ("2G", "ambiguous"), ("1T", "ambiguous"),
    ("12XB", "unknown unit 'XB'"), ("4 KiB B", "cannot read"), ("", "cannot read"), ("KiB", "cannot read"),
    ("nan", "cannot read"), ("inf", "cannot read"), ("1.2.3", "cannot read"), ("-4KiB", "negative"),
    ("-1", "negative"), ("1e30", "over 9223372036854775807 bytes"), ("1e999", "over"), ("9e99999999999", "over"),
    ("0.5B", "not a whole number"), ("1.0001kB", "not a whole number"), ("1e-99999999999", "not a whole number")])
def test_parse_size_refuses_with_a_message_naming_the_text(text, message):
    with pytest.raises(ValueError, match=message) as info:
        parse_size(text)
    assert repr(text) in str(info.value)


def test_the_largest_size_is_int64():
    assert parse_size(str(MAX_SIZE)) == MAX_SIZE == (1 << 63) - 1
    with pytest.raises(ValueError):
        parse_size(str(MAX_SIZE + 1))


@pytest.mark.parametrize("nbytes, label", [
    (0, "0B"), (500, "500B"), (1000, "1000B"), (1023, "1023B"), (1024, "1KiB"), (1536, "1.5KiB"), (4096, "4KiB"),
    (6000, "6kB"), (100_000, "100kB"), (786432, "768KiB"), (1572864, "1.5MiB"), (3_000_000, "3MB"),
    (2_048_000, "2.048MB"), (1025 << 10, "1025KiB"), (1_234_567, "1234.567kB"), (12_582_918, "12582.918kB"),
    (10**9, "1GB"), (1 << 30, "1GiB"), (10**12, "1000GB"), (3 << 40, "3072GiB")])
def test_format_size_is_binary_where_exact_else_decimal_else_bytes(nbytes, label):
    assert format_size(nbytes) == label == format_bytes(nbytes)


def test_format_size_refuses_negative():
    with pytest.raises(ValueError, match="-1"):
        format_size(-1)


@given(st.integers(0, MAX_SIZE))
def test_every_label_reads_back_exactly(nbytes):
    assert parse_size(format_size(nbytes)) == nbytes


@given(st.integers(0, 1 << 20), st.sampled_from(sorted({**DECIMAL_UNITS, **BINARY_UNITS}.items())),
       st.sampled_from(["", " "]), st.booleans())
def test_whole_counts_of_every_unit(count, unit, space, lower):
    name, scale = unit
    assert parse_size(f"{count}{space}{name.lower() if lower else name}") == count * scale


@given(st.integers(1, 1023), st.sampled_from([("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30)]))
def test_whole_binary_units_are_labelled_in_them(count, unit):
    name, scale = unit
    assert format_size(count * scale) == f"{count}{name}"
