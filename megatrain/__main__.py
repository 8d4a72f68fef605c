"""`python -m megatrain` (what torchrun's `-m megatrain` runs): the command line."""

import sys

from .cli import main

sys.exit(main())
