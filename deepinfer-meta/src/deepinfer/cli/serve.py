"""``deepinfer serve``: its options and the uvicorn server that runs the app.

Importing this module is cheap (no torch, no FastAPI): the ``deepinfer`` command registers the
subcommand even where the ``serve`` extra is not installed, and says how to install it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

EXTRA_HINT = "pip install 'deepinfer[serve]'"
SWITCH_INTERVAL_S = 0.0005


def _origins(value: str) -> list[str]:
    return [o.strip() for o in value.split(",") if o.strip()]


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Options of ``deepinfer serve`` (every one is documented in docs/guide/10-serving.md)."""
    from deepinfer.runtime.engine_args import EngineArgs

    m = EngineArgs.add_cli_args(p)  # the options generate, chat and bench take
    m.add_argument("--data-parallel-size", type=int, default=1,
                   help="independent engine replicas, one process per group of --tensor-parallel-size "
                        "GPUs (or N CPU replicas, --threads each: default the cores divided among them)")
    h = p.add_argument_group("HTTP")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on")
    h.add_argument("--port", type=int, default=8000, help="port (0: any free port, printed at start)")
    h.add_argument("--api-key", default=os.environ.get("DEEPINFER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1, /tokenize, /detokenize "
                        "(default: $DEEPINFER_API_KEY; unset = no key)")
    h.add_argument("--served-model-name", nargs="+", default=None,
                   help="model names clients may ask for (default: the model file's name)")
    h.add_argument("--max-queue", type=int, default=1024,
                   help="requests that may wait beyond --max-num-seqs; more get 503")
    h.add_argument("--allowed-origins", type=_origins, default=[],
                   help="comma-separated CORS origins ('*' for any; default: no CORS)")
    # request limits and cross-site checks (issue 29; docs/guide/10-serving.md, "Limits")
    h.add_argument("--allowed-hosts", type=_origins, default=[],
                   help="comma-separated names the Host header may give besides IP addresses, localhost and "
                        "--host ('.example.com': the domain and its subdomains; '*': any)")
    h.add_argument("--max-request-bytes", type=int, default=4 << 20,
                   help="largest request body; larger ones get 413 (default 4 MiB)")
    h.add_argument("--max-stop-strings", type=int, default=4,
                   help="most strings in a request's stop list (OpenAI's limit, 4); more get 400")
    h.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds in-flight requests may take before they are aborted")
    h.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _check(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.api_key == "":
        raise ValueError("--api-key must not be empty")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if args.max_stop_strings < 0:
        raise ValueError(f"--max-stop-strings must be >= 0, got {args.max_stop_strings}")


def default_served_name(model_path: str) -> str:
    name = os.path.basename(os.fspath(model_path).rstrip("/"))
    return name[:-5] if name.lower().endswith(".gguf") else name


def _uvicorn_server(app: Any, args: argparse.Namespace) -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that a handled SIGTERM/SIGINT ends with exit status 0 (uvicorn
        re-raises the signal after its graceful shutdown) and the bound address is printed."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            import signal
            import threading

            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            old = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            for server in getattr(self, "servers", []):
                for sock in server.sockets:
                    host, port = sock.getsockname()[:2]
                    logging.getLogger("deepinfer.serve").info("listening on http://%s:%d", host, port)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            timeout_graceful_shutdown=args.shutdown_timeout, lifespan="on")
    return Server(config)


def run_serve(args: argparse.Namespace) -> int:
    """Load the model and serve it until SIGTERM/SIGINT (exit 0) with parsed ``add_serve_args``."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        print(f"deepinfer serve: error: {exc.name} is not installed: {EXTRA_HINT}", file=sys.stderr)
        return 2
    from deepinfer.serve.replicas import ReplicaError

    try:
        _check(args)
        logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
        from deepinfer.serve.app import ServeConfig, build_app

        llm = _load(args)
        try:
            names = args.served_model_name or [default_served_name(llm.model_path)]
            app = build_app(llm, ServeConfig(served_model_names=names, api_key=args.api_key,
                                             max_queue=args.max_queue, allowed_origins=args.allowed_origins,
                                             host=args.host, allowed_hosts=args.allowed_hosts,
                                             max_request_bytes=args.max_request_bytes,
                                             max_stop_strings=args.max_stop_strings))
        except BaseException:
            _stop_replicas(llm)
            raise
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"deepinfer serve: error: {exc}", file=sys.stderr)
        return 2
    except ReplicaError as exc:  # a replica process that could not start
        print(f"deepinfer serve: error: {exc}", file=sys.stderr)
        return 1
    # The engine thread releases the GIL inside every torch op and must get it back after each;
    # with the default 5 ms switch interval the event loop's HTTP work can hold it that long
    # every time (measured: serve/generate throughput 0.86 -> 0.93 at 16 clients on 2 cores).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        _uvicorn_server(app, args).run()
    finally:
        _stop_replicas(llm)  # the app's shutdown stops them; this covers a server that never started
    return 0


def _load(args: argparse.Namespace) -> Any:
    """The in-process LLM, or with --data-parallel-size N > 1 the N replica processes."""
    from deepinfer.runtime.engine_args import EngineArgs

    kwargs = EngineArgs.from_cli_args(args).to_kwargs()
    if args.data_parallel_size > 1:
        from deepinfer.serve.replicas import ReplicaSet

        return ReplicaSet(kwargs, args.data_parallel_size, args.tensor_parallel_size, log_level=args.log_level)
    from deepinfer.runtime.llm import LLM

    return LLM(**kwargs)


def _stop_replicas(llm: Any) -> None:
    stop = getattr(llm, "stop", None)  # a ReplicaSet (an LLM has none)
    if stop is not None:
        stop()


def register(subparsers: Any) -> None:
    """Add ``serve`` to the ``deepinfer`` command's subparsers."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (extra deepinfer[serve])")
    add_serve_args(p)
    p.set_defaults(func=run_serve)
