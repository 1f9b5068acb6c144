"""``python -m kvpage``: the ``kvpage`` command line (see ``kvpage.cli``)."""

from kvpage.cli import main

raise SystemExit(main())
