"""`python -m trl_fp8 ...` is the `trl-fp8` command."""

import sys

from .cli import main

sys.exit(main())
