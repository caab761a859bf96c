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
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json")  # as serve/tools.py names them


def _origins(value: str) -> list[str]:
    return [o.strip() for o in value.split(",") if o.strip()]


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Options of ``deepinfer serve`` (every one is documented in docs/guide/10-serving.md)."""
    from deepinfer.runtime.engine_args import EngineArgs

    m = EngineArgs.add_cli_args(p)  # the options generate, chat and bench take
    m.add_argument("--data-parallel-size", type=int, default=1,
                   help="independent engine replicas, one engine-core process per group of "
                        "--tensor-parallel-size GPUs (or N CPU replicas, --threads each: default the cores divided "
                        "among them); every front end places requests on all of them")
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
    # tool calling (issue 26; docs/guide/13-structured-outputs.md, "Tool calling")
    t = p.add_argument_group("tool calling")
    t.add_argument("--tool-call-parser", default="auto", choices=list(TOOL_CALL_PARSERS),
                   help="how tool calls are read from the output (tool_choice auto): hermes "
                        "(<tool_call>{...}</tool_call>), llama3_json ({\"name\": ..., \"parameters\": ...}), or "
                        "auto: chosen from the chat template (default)")
    t.add_argument("--chat-template", default=None,
                   help="the chat template to use instead of the model's: a file, or the Jinja text itself "
                        "(for a model without one, or to override it)")
    t.add_argument("--trust-request-chat-template", action="store_true",
                   help="let a request's chat_template field replace the template (off: a 400; a template is "
                        "code the server runs, and a hostile one can spin a CPU for as long as it likes)")
    t.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted as vLLM takes it; tool_choice auto is always on here (a request's tools are "
                        "parsed from its output whether or not this is given)")
    # the engine-core process and its front ends (issue 25; docs/guide/10-serving.md, "Processes")
    c = p.add_argument_group("engine core and front ends")
    c.add_argument("--api-server-count", type=int, default=None,
                   help="HTTP front-end processes (they share the port), each connected to every engine core "
                        "(default: one per 8 CPU cores this process may use, at most 2; 1 with "
                        "--engine-in-process)")
    c.add_argument("--stream-interval", type=int, default=1,
                   help="a stream chunk waits for at least this many new tokens of its request (or its end); "
                        "every token available when a chunk is sent goes into it")
    c.add_argument("--max-stream-buffer", type=int, default=4096,
                   help="engine steps a stream may have waiting for a client that does not read; past it "
                        "the stream is cut with an error and its request aborted")
    c.add_argument("--arrival-gap-ms", type=float, default=None,
                   help="an idle engine that receives a request waits for more requests while they keep "
                        "arriving within this many milliseconds of each other (at most 10 such gaps) before "
                        "its first step, so a burst is prefilled together (default: 3 on CPU, 0 on a GPU)")
    c.add_argument("--engine-in-process", action="store_true",
                   help="run the engine loop in a thread of the HTTP process (the server before the engine "
                        "core; one process, one GIL)")


def default_api_server_count(engine_in_process: bool, cpus: int | None = None) -> int:
    """Front ends when ``--api-server-count`` is not given: one per 8 usable CPU cores, at most 2;
    1 in process. Every front end handles every step's message, so each one more costs CPU per
    step: on the H200's 16-core host (2026-12-04, SmolLM2 shape, 64 / 256 streams) two front ends
    spent 26-29 / 16-19 us of CPU a token beside the core against four's 38-43 / 22-24, with the
    same throughput and latency within the runs' spread; one front end, the least CPU, leaves one
    event loop to both accept and stream. On a 2-core machine more only compete with the core."""
    if engine_in_process:
        return 1
    if cpus is None:
        try:
            cpus = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            cpus = os.cpu_count() or 1
    return max(1, min(2, cpus // 8))


def _check(args: argparse.Namespace) -> None:
    if args.api_server_count is None:
        args.api_server_count = default_api_server_count(args.engine_in_process)
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    for flag in ("api_server_count", "max_stream_buffer"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    # the server's own limits, as the app checks them, named by their flags (before the model loads)
    serve_config(args, getattr(args, "model", None) or "model").check(lambda field: "--" + field.replace("_", "-"))
    if args.api_server_count > 1 and args.engine_in_process:
        raise ValueError(f"--api-server-count {args.api_server_count} needs the engine-core process; "
                         "--engine-in-process serves from one front end only")


def default_served_name(model_path: str) -> str:
    name = os.path.basename(os.fspath(model_path).rstrip("/"))
    return name[:-5] if name.lower().endswith(".gguf") else name


def _uvicorn_server(app: Any, args: argparse.Namespace, announce: bool = True,
                    on_started: Any = None) -> Any:
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
            if on_started is not None and not self.should_exit:
                on_started()
            for server in getattr(self, "servers", []) if announce else []:
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
    # torch before any native module (the engine's, msgspec's, zmq's): this process imports torch
    # anyway (the engine arguments' checks, the replica plan), and where a module loaded first
    # holds its own C++ runtime, torch's import crashes (docs/troubleshooting.md; seen on the H200
    # machine with engine wheels built there: `deepinfer serve` died with SIGSEGV at start)
    with contextlib.suppress(ImportError):
        import torch  # noqa: F401
    from deepinfer.serve.client import CoreError
    from deepinfer.serve.replicas import ReplicaError

    try:
        _check(args)
        logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
        from deepinfer.serve.app import build_app

        if _uses_core(args):
            cores = start_cores(args)
            if args.api_server_count > 1:
                return _supervise(args, cores)
            return _serve_one_frontend(args, cores)
        llm = _load(args)
        try:
            app = build_app(llm, serve_config(args, llm.model_path))
        except BaseException:
            _stop_replicas(llm)
            raise
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"deepinfer serve: error: {exc}", file=sys.stderr)
        return 2
    except (ReplicaError, CoreError) as exc:  # a replica / engine-core process that could not start
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


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``'s template (vLLM's rule): the text of the file it names, else the value
    itself when it looks like a template (it has a brace or a line break); a ValueError naming the
    flag otherwise, or when the template does not compile."""
    if value is None:
        return None
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template: cannot read {value!r}: {exc}") from None
    elif any(c in value for c in "{}\n"):
        text = value
    else:
        raise ValueError(f"--chat-template: no file at {value!r}, and it is not a Jinja template either")
    if not text.strip():
        raise ValueError(f"--chat-template: {value!r} is empty")
    from deepinfer.runtime.loading.text_tokenizer import check_chat_template

    check_chat_template(text, "--chat-template")
    return text


def serve_config(args: argparse.Namespace, model_path: str) -> Any:
    """The app's ServeConfig from the parsed options."""
    from deepinfer.serve.app import ServeConfig

    names = args.served_model_name or [default_served_name(model_path)]
    return ServeConfig(served_model_names=names, api_key=args.api_key, max_queue=args.max_queue,
                       allowed_origins=args.allowed_origins, host=args.host, allowed_hosts=args.allowed_hosts,
                       max_request_bytes=args.max_request_bytes, max_stop_strings=args.max_stop_strings,
                       stream_interval=args.stream_interval, arrival_gap_ms=getattr(args, "arrival_gap_ms", None),
                       tool_call_parser=getattr(args, "tool_call_parser", "auto"),
                       chat_template=load_chat_template(getattr(args, "chat_template", None)),
                       trust_request_chat_template=getattr(args, "trust_request_chat_template", False))


# ---- the engine-core process and its front ends (issue 25) ----------------------------------
CORE_DEATH_HEALTH_S = 1.0  # a front end whose core died answers /health with 503 this long, then shuts down
CORE_DEATH_EXIT_S = 3.5  # and exits (status 1) at the latest this long after the core's death


def _uses_core(args: argparse.Namespace) -> bool:
    return not args.engine_in_process


def start_cores(args: argparse.Namespace) -> list[Any]:
    """The engine-core processes: one, or one per data-parallel replica (its device group, its
    seed), loading their models together. A core that cannot load raises its error (the others
    are stopped)."""
    from deepinfer.serve.core_process import CoreProcess

    kwargs = _llm_kwargs(args)
    n = args.data_parallel_size
    if n == 1:
        return [CoreProcess(kwargs, log_level=args.log_level, arrival_gap_ms=args.arrival_gap_ms)]
    from deepinfer.serve.replicas import plan_replicas, replica_seed

    placements = plan_replicas(kwargs.pop("device", None), n, args.tensor_parallel_size,
                               kwargs.pop("num_threads", None))
    cores: list[Any] = []
    try:
        for i, place in enumerate(placements):
            llm_i = {**kwargs, "device": place.device, "num_threads": place.num_threads,
                     "seed": replica_seed(kwargs.get("seed", 0), i)}
            cores.append(CoreProcess(llm_i, log_level=args.log_level, env=place.env, wait=False,
                                     name=f"replica {i}", arrival_gap_ms=args.arrival_gap_ms))
        for c in cores:
            c.wait_ready()
    except BaseException:
        for c in cores:
            c.stop(10.0)
        raise
    return cores


def _llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from deepinfer.runtime.engine_args import EngineArgs

    return EngineArgs.from_cli_args(args).to_kwargs()  # type: ignore[no-any-return]


def run_frontend(args: argparse.Namespace, addresses: list[str], infos: list[dict[str, Any]],
                 sockets: list[Any] | None = None, announce: bool = True, on_started: Any = None) -> int:
    """Serve HTTP as one front end of the engine cores at ``addresses`` until SIGTERM/SIGINT (0)
    or every core's death (1: every open request got its error first; at most CORE_DEATH_EXIT_S
    later)."""
    import threading

    from deepinfer.serve.app import build_app
    from deepinfer.serve.client import EngineClient

    status = {"code": 0}
    server: Any = None

    def on_core_death(reason: str) -> None:
        status["code"] = 1

        def shut_down() -> None:
            if server is not None:
                server.should_exit = True

        # every stream has its error event now; /health answers 503 for a moment, then the
        # server shuts down, and a connection that does not close cannot keep it up
        for delay, action in ((CORE_DEATH_HEALTH_S, shut_down), (CORE_DEATH_EXIT_S, lambda: os._exit(1))):
            t = threading.Timer(delay, action)
            t.daemon = True
            t.start()

    client = EngineClient(addresses, infos, max_stream_buffer=args.max_stream_buffer, on_core_death=on_core_death)
    app = build_app(client, serve_config(args, client.model_path))
    server = _uvicorn_server(app, args, announce=announce, on_started=on_started)
    server.run(sockets=sockets)
    return status["code"]


def _serve_one_frontend(args: argparse.Namespace, cores: list[Any]) -> int:
    try:
        code = run_frontend(args, [c.address for c in cores], [c.info for c in cores])
    finally:
        core_codes = [c.stop(10.0) for c in cores]
    bad = [(c.name, k) for c, k in zip(cores, core_codes, strict=True) if k not in (0, None, -15)]
    if code == 0 and bad and len(cores) == 1:
        logging.getLogger("deepinfer.serve").error("the engine core exited with code %s", bad[0][1])
        return 1
    return code


def _supervise(args: argparse.Namespace, cores: list[Any]) -> int:
    """--api-server-count N > 1: N front-end processes accept on one listening socket bound
    here; this process watches them and the cores. The death of every core ends the server
    (status 1; with data-parallel replicas one dead core costs only its requests); a front end's
    death costs only its own requests (the cores abort them); SIGTERM/SIGINT drains every front
    end, then stops the cores (status 0)."""
    import json
    import signal
    import socket
    import subprocess
    import time

    log = logging.getLogger("deepinfer.serve")
    try:
        sock = socket.create_server((args.host, args.port), backlog=2048)
    except OSError:
        for c in cores:
            c.stop(10.0)
        raise
    sock.set_inheritable(True)
    host, port = sock.getsockname()[:2]
    options = {k: v for k, v in vars(args).items() if k != "func"}
    frontends = []
    ready_pipes = []
    for i in range(args.api_server_count):
        ready_r, ready_w = os.pipe()  # the front end writes one byte once it serves
        config = {"options": options, "fd": sock.fileno(), "addresses": [c.address for c in cores],
                  "infos": [c.info for c in cores], "index": i, "ready_fd": ready_w}
        frontends.append(subprocess.Popen([sys.executable, "-m", "deepinfer.cli.serve", json.dumps(config)],
                                          pass_fds=(sock.fileno(), ready_w), stdin=subprocess.DEVNULL))
        os.close(ready_w)
        ready_pipes.append(ready_r)
    # "listening" once every front end serves: each has said hello to every core by then, so
    # each sees (in its /metrics) every request the others are sent from then on
    for r in ready_pipes:
        try:
            os.read(r, 1)  # b"" when that front end exited first: the loop below reports it
        finally:
            os.close(r)
    log.info("engine core pid%s %s; %d front ends: pids %s", "s" if len(cores) > 1 else "",
             ", ".join(str(c.pid) for c in cores), len(frontends), ", ".join(str(p.pid) for p in frontends))
    log.info("listening on http://%s:%d", host, port)
    stop: dict[str, int | None] = {"signal": None}

    def on_signal(signum: int, frame: Any) -> None:
        stop["signal"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    reported: set[int] = set()
    reported_cores: set[int] = set()
    code = 0
    try:
        while True:
            if stop["signal"] is not None:
                for p in frontends:
                    if p.poll() is None:
                        p.send_signal(signal.SIGTERM)
                _wait_all(frontends, args.shutdown_timeout + 10.0)
                break
            for c in cores:
                if c.poll() is not None and c.pid not in reported_cores:
                    reported_cores.add(c.pid)
                    log.error("the %s (pid %d) exited with code %s", c.name, c.pid, c.poll())
            if len(reported_cores) == len(cores):
                log.error("no engine core runs: the server exits")
                _wait_all(frontends, CORE_DEATH_EXIT_S + 1.0)
                code = 1
                break
            for i, p in enumerate(frontends):
                if p.poll() is not None and i not in reported:
                    reported.add(i)
                    log.error("front end %d (pid %d) exited with code %s; the engine aborted its requests, the "
                              "other front ends serve on", i, p.pid, p.returncode)
            if len(reported) == len(frontends):
                log.error("every front end exited: the server exits")
                code = 1
                break
            time.sleep(0.05)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _wait_all(frontends, 0.0)
        sock.close()
        for c in cores:
            c.stop(10.0)
    return code


def _wait_all(procs: list[Any], timeout: float) -> None:
    """Wait up to ``timeout`` s for every process; kill those still running."""
    import subprocess
    import time

    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def _load(args: argparse.Namespace) -> Any:
    """--engine-in-process: the in-process LLM, or with --data-parallel-size N > 1 the N replica
    processes behind this one HTTP process (the layout before the engine core)."""
    from deepinfer.runtime.engine_args import EngineArgs

    kwargs = EngineArgs.from_cli_args(args).to_kwargs()
    if args.data_parallel_size > 1:
        from deepinfer.serve.replicas import ReplicaSet

        return ReplicaSet(kwargs, args.data_parallel_size, args.tensor_parallel_size, log_level=args.log_level)
    from deepinfer.runtime.llm import LLM
    from deepinfer.serve.engine_defaults import serve_llm_kwargs

    return LLM(**serve_llm_kwargs(kwargs))


def _stop_replicas(llm: Any) -> None:
    stop = getattr(llm, "stop", None)  # a ReplicaSet (an LLM has none)
    if stop is not None:
        stop()


def frontend_main(config: dict[str, Any]) -> int:
    """One front-end process of ``--api-server-count N > 1``, started by the supervisor as
    ``python -m deepinfer.cli.serve CONFIG_JSON`` (a fresh interpreter) with the listening socket
    every front end shares as an inherited descriptor. Exits 0 after SIGTERM (drained), 1 when
    the engine core is gone."""
    import socket

    args = argparse.Namespace(**config["options"])
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s [front end {config['index']}]: %(message)s")
    sock = socket.socket(fileno=config["fd"])  # family and type read from the descriptor
    ready_fd = config.get("ready_fd")

    def on_started() -> None:  # tell the supervisor that this front end serves
        if ready_fd is not None:
            with contextlib.suppress(OSError):
                os.write(ready_fd, b"r")
                os.close(ready_fd)

    return run_frontend(args, config["addresses"], config["infos"], sockets=[sock], announce=False,
                        on_started=on_started)


def register(subparsers: Any) -> None:
    """Add ``serve`` to the ``deepinfer`` command's subparsers."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (extra deepinfer[serve])")
    add_serve_args(p)
    p.set_defaults(func=run_serve)


if __name__ == "__main__":  # a front-end process of the supervisor (never the user's entry point)
    import json

    if len(sys.argv) != 2:
        print("usage: python -m deepinfer.cli.serve CONFIG_JSON (started by deepinfer serve)", file=sys.stderr)
        sys.exit(2)
    sys.exit(frontend_main(json.loads(sys.argv[1])))
