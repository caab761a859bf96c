"""``python -m deepinfer`` is the ``deepinfer`` command."""

import sys

try:
    from deepinfer.cli import main
except KeyboardInterrupt:  # Ctrl-C before the command started: no traceback
    sys.exit(130)

sys.exit(main())
