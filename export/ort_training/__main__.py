"""``python -m export.ort_training``: see :mod:`export.ort_training.cli`."""

import sys

from export.ort_training.cli import main

sys.exit(main())
