"""Entry-point helper: a user's mistake is one line on stderr and exit status 2, never a traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from distillspec.errors import DistillSpecError


def run_main(main: Callable[[], Any]) -> None:
    try:
        main()
    except DistillSpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
