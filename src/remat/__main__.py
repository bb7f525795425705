import sys

from remat.cli import main

sys.exit(main())
