"""Where a process's seconds go: wall time per named phase (calibration, MFF, sweeps, scoring, training).

The library's long steps are wrapped in :func:`phase` (or decorated with :func:`timed`), and every
provenance record a notebook writes carries :func:`seconds` (``"phases"``), so a run's record says
how its wall time divides, not only how long it took. The attribution is exclusive: a phase
nested inside another (MFF inside a compression, a weighted SVD inside a sensitivity sweep)
counts for itself only, and the outer phase for the rest of its time. What no phase covers
(imports, plotting, the notebook's own Python) is the wall time minus the sum.

>>> import time
>>> reset()
>>> with phase("outer"):
...     with phase("inner"):
...         time.sleep(0.02)
>>> s = seconds()
>>> s["inner"] >= 0.02 and s["outer"] < s["inner"]
True
"""
from __future__ import annotations

import functools
import threading
import time
from contextlib import contextmanager

__all__ = ["phase", "timed", "seconds", "reset"]

_LOCK = threading.Lock()
_SECONDS: dict[str, float] = {}
_LOCAL = threading.local()  # each thread's stack of [name, start of its running span]


def _add(name: str, dt: float) -> None:
    with _LOCK:
        _SECONDS[name] = _SECONDS.get(name, 0.0) + dt


@contextmanager
def phase(name: str):
    """Count the block's wall time under ``name``, less the time of the phases nested in it."""
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    now = time.perf_counter()
    if stack:  # the enclosing phase pauses
        _add(stack[-1][0], now - stack[-1][1])
    stack.append([name, now])
    try:
        yield
    finally:
        now = time.perf_counter()
        inner, start = stack.pop()
        _add(inner, now - start)
        if stack:  # ... and resumes
            stack[-1][1] = now


def timed(name: str):
    """Decorator: every call of the function is a :func:`phase` named ``name``."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with phase(name):
                return fn(*args, **kwargs)
        return inner
    return wrap


def seconds() -> dict[str, float]:
    """Seconds per phase so far in this process (finished spans only), largest first."""
    with _LOCK:
        items = sorted(_SECONDS.items(), key=lambda kv: -kv[1])
    return {k: round(v, 3) for k, v in items}


def reset() -> None:
    """Forget the seconds counted so far (a new measurement in the same process)."""
    with _LOCK:
        _SECONDS.clear()
