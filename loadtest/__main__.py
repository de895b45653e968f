import sys

from loadtest.cli import main

sys.exit(main())
