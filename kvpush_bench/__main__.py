"""`python -m kvpush_bench <sub-command>`; see kvpush_bench.cli."""

import sys

from kvpush_bench.cli import main

sys.exit(main())
