import sys

from benchmarks.allreduce.runner import main

sys.exit(main())
