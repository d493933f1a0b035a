"""Every test starts with the signal handling Python starts with.

A test that changes the SIGINT / SIGTERM handlers or the signal mask of the main thread and does
not put them back (a crash inside a context that swaps handlers, a subprocess helper) would change
what a later test of Ctrl-C sees. The fixture puts them back after each test and says which test
left them changed (a warning naming it), so one test's leftovers never decide another's result.
"""
import signal
import threading
import warnings

import pytest

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@pytest.fixture(autouse=True)
def _signals_as_found(request):
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handlers = {s: signal.getsignal(s) for s in _SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    changed = [s.name for s in _SIGNALS if signal.getsignal(s) is not handlers[s]]
    if signal.pthread_sigmask(signal.SIG_SETMASK, mask) != mask:
        changed.append("signal mask")
    for s, h in handlers.items():
        signal.signal(s, h if h is not None else signal.SIG_DFL)
    if changed:
        warnings.warn(f"{request.node.nodeid} left {', '.join(changed)} changed; put back", stacklevel=1)
