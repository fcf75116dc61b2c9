"""Money is integer micro-dollars everywhere; this is how it is read from and shown to people.

parse_usd() is the one place a dollar amount becomes micro-dollars (the staff forms, set_quota),
so every door into the ledger's caps and prices applies the same rule.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

MICRO_USD_PER_USD = 1_000_000
USD_DECIMALS = 6  # one micro-dollar is the smallest amount Ceiling keeps


class NotAnAmount(ValueError):
    """The text is not a (finite) number of dollars at all."""


class NegativeAmount(ValueError):
    """A cap, limit or price is never below zero."""


class TooPrecise(ValueError):
    """More decimals than micro-dollars can hold: refused rather than silently rounded."""


def parse_usd(text: str | Decimal) -> int:
    """'1.25' → 1_250_000: dollars as exact integer micro-dollars, zero or more.

    Decimal, never float, so '0.000001' is exactly 1. Raises a ValueError subclass (NotAnAmount,
    NegativeAmount, TooPrecise) whose message says what is wrong; callers that need their own
    wording (a form, a command-line flag) catch the subclass.
    """
    if isinstance(text, Decimal):
        dollars = text
    else:
        try:
            dollars = Decimal(text.strip())
        except InvalidOperation:
            raise NotAnAmount(f"{text!r} is not an amount in dollars.") from None
    if not dollars.is_finite():
        raise NotAnAmount(f"{text!r} is not an amount in dollars.")
    if dollars < 0:
        raise NegativeAmount(f"An amount in dollars cannot be negative, not {text}.")
    micro = dollars * MICRO_USD_PER_USD
    if micro != micro.to_integral_value():
        raise TooPrecise(f"{text} has more than {USD_DECIMALS} decimals; the smallest amount is $0.000001.")
    return int(micro)


def format_usd(micro_usd: int) -> str:
    """$1,234.56 — or, below a cent, enough decimals that it is not shown as $0.00."""
    dollars = micro_usd / MICRO_USD_PER_USD
    if micro_usd and abs(dollars) < 0.01:
        return f"${dollars:.6f}"
    return f"${dollars:,.2f}"


def exact_usd(micro_usd: int) -> str:
    """$1.50, $0.000001: unlike format_usd, a change of one micro-dollar shows (the audit trail, prices)."""
    whole, fraction = f"{Decimal(micro_usd) / MICRO_USD_PER_USD:,.6f}".split(".")
    return f"${whole}.{fraction.rstrip('0').ljust(2, '0')}"
