"""``python -m neuronfx`` (and ``torchrun -m neuronfx``): the command line of :mod:`neuronfx.cli`."""

import sys

from neuronfx.cli import main

sys.exit(main())
