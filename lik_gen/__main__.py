import sys

from lik_gen.cli import main

sys.exit(main())
