"""Start-up of the command-line entry points, before their heavy imports (torch takes seconds).

Imports nothing but the standard library: it runs before torch is imported, so that Ctrl-C or
SIGTERM during start-up ends the command with one line instead of an import's traceback.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, NoReturn

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
INTERRUPTED = 128 + signal.SIGINT  # the exit status of a command stopped by Ctrl-C
TERMINATED = 128 + signal.SIGTERM  # and by SIGTERM
_BEFORE_START: dict[int, Any] = {}  # the handlers quiet_start replaced, which started() puts back


def quiet_start(module_name: str) -> None:
    """When `module_name` is "__main__" (python -m mode.X): until the command installs its own
    handlers, SIGINT and SIGTERM end the process at once with one line; nothing has been written
    yet. A SIGINT ignored on entry (a background job) stays ignored."""
    if module_name != "__main__" or threading.current_thread() is not threading.main_thread():
        return

    def leave(signum: int, frame: Any) -> None:
        name = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        os.write(sys.stderr.fileno(), f"\n{name} while starting: nothing was written\n".encode())
        os._exit(128 + signum)  # no traceback, no half-imported module's teardown

    _BEFORE_START.update(handle_stop_signals(leave))


def started() -> None:
    """The command's imports are done: the signal handlers quiet_start replaced are back (Python's
    KeyboardInterrupt for Ctrl-C), for the command's main() to use or replace."""
    restore_handlers(_BEFORE_START)
    _BEFORE_START.clear()


def handle_stop_signals(handler: Any) -> dict[int, Any]:
    """`handler` for SIGTERM, and for SIGINT unless it is ignored (a script's background job keeps it
    ignored, as Python does); returns the handlers it replaced, for restore_handlers."""
    return {number: signal.signal(number, handler) for number in STOP_SIGNALS
            if not (number == signal.SIGINT and signal.getsignal(number) == signal.SIG_IGN)}


def restore_handlers(previous: dict[int, Any]) -> None:
    """Put back the handlers handle_stop_signals (or a caller) saved."""
    for number, handler in previous.items():
        signal.signal(number, handler if handler is not None else signal.SIG_DFL)


def ignore_stop_signals() -> None:
    """From now on SIGINT and SIGTERM are ignored: a stop under way finishes and says where the run
    stands, and a finished command's exit is not cut short. Main thread only (signals go there)."""
    if threading.current_thread() is threading.main_thread():
        for number in STOP_SIGNALS:
            signal.signal(number, signal.SIG_IGN)


def finish(status: int) -> NoReturn:
    """Leave a command with its main()'s status; a signal now would only garble the interpreter's exit."""
    ignore_stop_signals()
    sys.exit(status)
