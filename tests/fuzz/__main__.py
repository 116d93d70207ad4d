"""python3 -m tests.fuzz — see tests/fuzz/driver.py and docs/testing.md."""
import sys

from .driver import main

sys.exit(main())
