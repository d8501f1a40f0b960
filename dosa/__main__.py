import sys

from dosa.cli import main

sys.exit(main())
