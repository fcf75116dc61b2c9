"""Money is integer micro-dollars everywhere; this is how it is shown to people."""


def format_usd(micro_usd: int) -> str:
    """$1,234.56 — or, below a cent, enough decimals that it is not shown as $0.00."""
    dollars = micro_usd / 1_000_000
    if micro_usd and abs(dollars) < 0.01:
        return f"${dollars:.6f}"
    return f"${dollars:,.2f}"
