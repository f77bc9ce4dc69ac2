"""``python -m memra_obs``: the ``memra-obs`` command where its script is not on PATH."""

from .cli import main

raise SystemExit(main())
