"""``python -m lik``: the lik command line (see lik.cli)."""

import sys

from lik.cli import main

sys.exit(main())
