"""``python -m ejkernel`` is the ``ejkernel`` command."""

from ejkernel.cli import main

raise SystemExit(main())
