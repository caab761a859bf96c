"""One HTTP front-end process of ``deepinfer serve --api-server-count N`` (N > 1).

Started by the supervisor (``deepinfer.cli.serve``) as ``python -m deepinfer.serve.frontend
CONFIG_JSON`` (a fresh interpreter), with the listening socket every front end shares passed as
an inherited file descriptor. It serves the app over an ``EngineClient`` of the engine core:
tokenizing, detokenized deltas to SSE, its own admission count. It exits 0 after SIGTERM (having
drained) and 1 when the engine core is gone.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
from typing import Any


def frontend_main(config: dict[str, Any]) -> int:
    from deepinfer.cli.serve import run_frontend

    args = argparse.Namespace(**config["options"])
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s [front end {config['index']}]: %(message)s")
    sock = socket.socket(fileno=config["fd"])  # family and type read from the descriptor
    return run_frontend(args, config["address"], config["info"], sockets=[sock], announce=False)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m deepinfer.serve.frontend CONFIG_JSON", file=sys.stderr)
        return 2
    return frontend_main(json.loads(args[0]))


if __name__ == "__main__":
    sys.exit(main())
