"""`python -m trl_fp8 ...` is the `trl-fp8` command."""

import sys

from trl_fp8.cli.main import main

sys.exit(main())
