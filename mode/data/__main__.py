"""`python -m mode.data prepare ...`: see mode/data/prepare.py."""
from __future__ import annotations

from mode.cli import finish, quiet_start

if __name__ == "__main__":
    quiet_start(__name__)  # Ctrl-C while the tokenizer's imports run ends with one line
    from mode.data.prepare import main

    finish(main())
