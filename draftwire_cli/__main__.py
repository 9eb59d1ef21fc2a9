"""`python -m draftwire_cli`: the `draftwire` command."""

import sys

from draftwire_cli.main import main

sys.exit(main())
