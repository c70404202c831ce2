"""`python -m pdfleet_runtime` is the `pdfleet-runtime` command."""

from pdfleet_runtime.cli import main

raise SystemExit(main())
