"""``python -m deepinfer`` is the ``deepinfer`` command."""

import sys

from deepinfer.cli import main

sys.exit(main())
