"""``python -m fastmm.bench``: the same as the ``fastmm-bench`` console script."""

from .cli import main

raise SystemExit(main())
