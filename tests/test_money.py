"""budgets.money.parse_usd: the one way a dollar amount becomes integer micro-dollars."""

from __future__ import annotations

from decimal import Decimal

import pytest

from budgets.money import NegativeAmount, NotAnAmount, TooPrecise, exact_usd, format_usd, parse_usd


@pytest.mark.parametrize(
    ("text", "micro_usd"),
    [
        ("0", 0),
        ("1", 1_000_000),
        ("1.25", 1_250_000),
        ("0.000001", 1),  # one micro-dollar, exactly: Decimal, never float
        ("0.1", 100_000),
        ("1.500000000", 1_500_000),  # trailing zeros are not precision
        (" 2.5 ", 2_500_000),
        ("1e3", 1_000_000_000),
        ("-0", 0),
        ("1000000000", 10**15),
        (Decimal("0.30"), 300_000),  # what a forms.DecimalField gives
    ],
)
def test_accepted_amounts(text, micro_usd):
    assert parse_usd(text) == micro_usd
    assert type(parse_usd(text)) is int


@pytest.mark.parametrize(
    ("text", "error", "message"),
    [
        ("lots", NotAnAmount, "is not an amount in dollars"),
        ("", NotAnAmount, "is not an amount in dollars"),
        ("$1.50", NotAnAmount, "is not an amount in dollars"),
        ("1,000", NotAnAmount, "is not an amount in dollars"),
        ("nan", NotAnAmount, "is not an amount in dollars"),
        ("Infinity", NotAnAmount, "is not an amount in dollars"),
        ("-1", NegativeAmount, "cannot be negative"),
        ("-0.000001", NegativeAmount, "cannot be negative"),
        ("0.0000001", TooPrecise, "more than 6 decimals"),
        ("1.0000015", TooPrecise, "more than 6 decimals"),
        (Decimal("-2"), NegativeAmount, "cannot be negative"),
    ],
)
def test_refused_amounts_say_why(text, error, message):
    with pytest.raises(error, match=message):
        parse_usd(text)


def test_every_refusal_is_a_value_error():
    for error in (NotAnAmount, NegativeAmount, TooPrecise):
        assert issubclass(error, ValueError)


def test_shown_amounts():
    assert format_usd(1_234_560_000) == "$1,234.56"
    assert format_usd(120) == "$0.000120"
    assert exact_usd(1_500_000) == "$1.50"
    assert exact_usd(1) == "$0.000001"
