"""Number formats and Markdown helpers of the README's generated blocks (:mod:`fisherkron.experiments.readme`).

Numbers are written as the README writes them by hand: thousands separators, a true minus sign
(``−0.7``), ``"33 %"`` with a space, ``1.7e6`` for perplexities beyond a million.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from . import Outputs

__all__ = ["MINUS", "ORDINALS", "num", "signed", "pct", "sci", "secs", "dur", "factor", "perplexity", "span",
           "and_list", "word", "table", "bold", "cpu", "cores", "machine_name", "method_name"]

MINUS = "\u2212"
WORDS = ["no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh"]



def num(x: float, d: int = 0) -> str:
    """Thousands separators, ``d`` decimals, a true minus sign.

    >>> num(1234.5), num(-0.74, 1), num(56.83, 1)
    ('1,234', '−0.7', '56.8')
    """
    s = f"{abs(x):,.{d}f}"
    return MINUS + s if x < 0 and s.strip("0.,") else s


def signed(x: float, d: int = 1) -> str:
    """``+1.0`` / ``−0.7``."""
    s = num(x, d)
    return s if s.startswith(MINUS) else "+" + s


def pct(x: float, d: int = 0) -> str:
    """A fraction as ``"33 %"``."""
    return f"{num(100 * x, d)} %"


def sci(x: float, d: int = 1) -> str:
    """``1.7e6``, ``5.4e-6``."""
    m, e = f"{x:.{d}e}".split("e")
    return f"{m}e{int(e)}"


def secs(s: float) -> str:
    """A duration: ``"0.8 s"``, ``"253 s"``, ``"44 min"``, ``"1 h 40 min"``."""
    if s < 10:
        return f"{s:.1f} s"
    if s < 600:
        return f"{s:.0f} s"
    m = round(s / 60)
    return f"{m} min" if m < 120 else f"{m // 60} h {m % 60} min"


def dur(s: float) -> str:
    """Seconds, with minutes beside them when there are many: ``"2,146 s (36 min)"``."""
    return f"{num(s)} s" + (f" ({secs(s)})" if s >= 600 else "")


def factor(v: float) -> str:
    """A factor: ``"3.8"``, ``"17"``, ``"11,653"``."""
    return num(v, 1) if v < 10 else num(v)


def perplexity(v: float) -> str:
    """``1,158``; ``1.7e6`` beyond a million."""
    return sci(v) if v >= 1e6 else num(v)


def span(vals: Iterable[float], fmt: Callable[[float], str], sep: str = "-") -> str:
    """``lo-hi`` of ``vals`` in ``fmt`` (one value when both ends format alike)."""
    vals = list(vals)
    lo, hi = fmt(min(vals)), fmt(max(vals))
    return lo if lo == hi else f"{lo}{sep}{hi}"


def and_list(items: Iterable[str]) -> str:
    """``"a, b and c"``."""
    items = list(items)
    return " and ".join([", ".join(items[:-1]), items[-1]]) if len(items) > 1 else "".join(items)


def word(n: int) -> str:
    """Small counts in words (``"three"``), larger ones in digits."""
    return WORDS[n] if 0 <= n < len(WORDS) else num(n)


def table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table."""
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
                      *("| " + " | ".join(r) + " |" for r in rows)])


def bold(s: str, on: bool) -> str:
    """``**s**`` where ``on``."""
    return f"**{s}**" if on else s


def cpu(out: Outputs, name: str) -> str:
    """``"2-core AMD EPYC"``: the machine a record was made on."""
    return machine_name(out.record(name).get("machine", {}))


def cores(share: float | None, idle: float = 0.1) -> str:
    """The share of the cores other processes used during a timing, in words (``fisherkron.env.OtherLoad``).

    >>> cores(None), cores(0.02), cores(0.4)
    ('not recorded', 'idle', 'shared (40 % other work)')
    """
    return "not recorded" if share is None else "idle" if share < idle else f"shared ({pct(share)} other work)"


def cpu_model(m: dict) -> str:
    """``"Intel Xeon"`` from a record's ``machine`` (its ``cpu``, trademarks and "Processor" dropped).

    >>> cpu_model({"cpu": "Intel(R) Xeon(R) Processor", "cpu_count": 2})
    'Intel Xeon'
    """
    return re.sub(r"\((R|TM)\)| Processor| CPU", "", str(m.get("cpu"))).strip()


def machine_name(m: dict) -> str:
    """``"2-core AMD EPYC"`` from a record's ``machine`` (its ``cpu`` and ``cpu_count``).

    >>> machine_name({"cpu": "Intel(R) Xeon(R) Processor", "cpu_count": 2})
    '2-core Intel Xeon'
    """
    return f"{m.get('cpu_count')}-core {cpu_model(m)}"


def method_name(key: str) -> str:
    """The display name of a method key (``svd_llm`` -> ``SVD-LLM``), as the study tables write it."""
    from ..glue_summary import NAMES
    from ..llm_summary import NAMES as DECODER_NAMES  # the decoder-only methods (Basis Sharing, the ablation's)
    return NAMES.get(key) or DECODER_NAMES.get(key, key)

