import sys

from host_lib.bench.runner import main

sys.exit(main())
