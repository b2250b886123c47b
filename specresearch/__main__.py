import sys

from specresearch.cli import main

sys.exit(main())
