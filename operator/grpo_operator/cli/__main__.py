"""`python -m grpo_operator.cli` runs the command line (what the console script calls)."""

import sys

from grpo_operator.cli import main

sys.exit(main())
