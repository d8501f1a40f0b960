"""``python -m dosa``: the ``dosa`` command (dosa.app.cli). Python looks for this file at the
package's top, so it sits here, in the application layer by docs/layers.md, and does nothing else."""
import sys

from dosa.app.cli import main

sys.exit(main())
