"""python -m mode.report: see mode.report."""
from __future__ import annotations

from mode.cli import finish, quiet_start

quiet_start(__name__)  # before torch: Ctrl-C while it imports ends with one line

from mode.report.command import main  # noqa: E402 (after quiet_start, as the other entry points)

if __name__ == "__main__":
    finish(main())
