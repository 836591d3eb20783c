"""``python -m aligner.gpu_check``: see :mod:`aligner.gpu_check.check`."""

import sys

from aligner.gpu_check.check import main

if __name__ == "__main__":
    sys.exit(main())
