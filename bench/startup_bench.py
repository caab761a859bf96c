"""Startup time: process start → first generated token, for ``deepinfer generate`` and the Python API.

    python bench/startup_bench.py [--repeats 3] [--model PATH] [--threads N]

Each measurement starts a fresh Python process (so imports, model loading, KV-cache allocation
and the first step are all counted) and times, from just before the process is spawned:

- ``cli``: ``python -m deepinfer generate PROMPT --max-tokens 8`` until its first byte of
  completion text reaches stdout (progress goes to stderr, so stdout holds only the completion);
- ``api``: a script doing ``from deepinfer import LLM`` → ``import torch`` → ``LLM()`` →
  ``llm.stream(PROMPT)`` until its first delta with a token; the script also reports when its
  imports finished and when ``LLM()`` returned, which splits the figure into import / load /
  first-step parts. ``first LLM()`` is the ``LLM()`` call alone (torch already imported): the
  load of the model, its tokenizer and the KV cache in a fresh process.

The contenders alternate (cli, api, cli, api, …) so machine load hits both alike; medians are
printed with the load average before and after (``--no-cli``: the API script only). The ``deepinfer --version`` and ``--help``
start-up times (which must not import torch) are printed too.

``--baseline-src DIR`` measures a second copy of the ``deepinfer`` sources (e.g. an older
checkout's ``deepinfer-meta/src``, put first on PYTHONPATH) in the same interleaved rounds and
prints the before/after ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

PROMPT = "The capital of France is"

API_SCRIPT = r"""
import sys, time
t0 = float(sys.argv[1])
from deepinfer import LLM, SamplingParams
t_import = time.time()
import torch
t_torch = time.time()
llm = LLM(sys.argv[2] or None, device="cpu", num_threads=int(sys.argv[3]) if sys.argv[3] else None)
t_load = time.time()
for delta in llm.stream(sys.argv[4], SamplingParams(temperature=0.0, max_tokens=8)):
    if delta.outputs[0].token_ids:
        break
t_first = time.time()
print(f"{t_import - t0:.3f} {t_torch - t0:.3f} {t_load - t0:.3f} {t_first - t0:.3f}", flush=True)
"""


def _first_stdout_byte(cmd: list[str], env: dict[str, str]) -> float:
    """Seconds from spawning ``cmd`` to its first byte on stdout (the process is then ended)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert proc.stdout is not None
    first = proc.stdout.read(1)
    dt = time.perf_counter() - t0
    proc.kill()
    proc.wait()
    if not first:
        raise RuntimeError(f"{cmd} printed nothing (exit status {proc.returncode})")
    return dt


def _api(model: str, threads: str, env: dict[str, str]) -> tuple[float, float, float, float]:
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", API_SCRIPT, repr(t0), model, threads, PROMPT],
                         capture_output=True, text=True, env=env, check=True)
    imp, torch_done, load, first = (float(x) for x in out.stdout.split())
    return imp, torch_done, load, first


def _wall(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, capture_output=True, env=env, check=False)
    return time.perf_counter() - t0


def _measure(env: dict[str, str], cli: list[str] | None, model: str, threads: str,
             runs: dict[str, list[float]]) -> None:
    if cli is not None:
        runs.setdefault("cli", []).append(_first_stdout_byte(cli, env))
    imp, torch_done, load, first = _api(model, threads, env)
    runs.setdefault("api", []).append(first)
    runs.setdefault("api_import", []).append(imp)
    runs.setdefault("api_loaded", []).append(load)
    runs.setdefault("llm", []).append(load - torch_done)
    runs.setdefault("load_average", []).append(os.getloadavg()[0])


def _report(name: str, runs: dict[str, list[float]]) -> None:
    med = statistics.median
    if "cli" in runs:
        print(f"[{name}] cli: start -> first token  {med(runs['cli']):6.2f} s   "
              f"(runs: {', '.join(f'{x:.2f}' for x in runs['cli'])})")
    print(f"[{name}] api: start -> first token  {med(runs['api']):6.2f} s   (imports done "
          f"{med(runs['api_import']):.2f} s, LLM() done {med(runs['api_loaded']):.2f} s; "
          f"runs: {', '.join(f'{x:.2f}' for x in runs['api'])})")
    print(f"[{name}] first LLM() (torch imported)  {med(runs['llm']):6.2f} s   (runs: "
          f"{', '.join(f'{x:.2f}' for x in runs['llm'])}; load average after each: "
          f"{', '.join(f'{x:.2f}' for x in runs['load_average'])})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="", help="GGUF file or HF directory (default: the embedded model)")
    parser.add_argument("--threads", default="", help="torch threads for both (default: torch's)")
    parser.add_argument("--baseline-src", default="",
                        help="another deepinfer source folder to compare with (put first on PYTHONPATH)")
    parser.add_argument("--no-cli", action="store_true", help="measure the API script only")
    args = parser.parse_args()
    env = dict(os.environ)
    cli = [sys.executable, "-m", "deepinfer", "generate", PROMPT, "--max-tokens", "8", "--device", "cpu"]
    if args.model:
        cli += ["--model", args.model]
    if args.threads:
        cli += ["--threads", args.threads]
    contenders = {"current": env}
    if args.baseline_src:
        contenders["baseline"] = {**env, "PYTHONPATH": os.pathsep.join(
            [args.baseline_src, *filter(None, [env.get("PYTHONPATH")])])}
        if args.threads:  # the baseline may predate --threads: the API path sets it for both
            cli = cli[:-2]
    cli_cmd = None if args.no_cli else cli

    load_before = os.getloadavg()
    version = [_wall([sys.executable, "-m", "deepinfer", "--version"], env) for _ in range(args.repeats)]
    help_ = [_wall([sys.executable, "-m", "deepinfer", "generate", "--help"], env) for _ in range(args.repeats)]
    runs: dict[str, dict[str, list[float]]] = {name: {} for name in contenders}
    for i in range(args.repeats):
        order = list(contenders) if i % 2 == 0 else list(reversed(contenders))
        for name in order:
            _measure(contenders[name], cli_cmd, args.model, args.threads, runs[name])
    load_after = os.getloadavg()

    med = statistics.median
    print(f"deepinfer --version          {med(version):6.2f} s")
    print(f"deepinfer generate --help    {med(help_):6.2f} s")
    for name in contenders:
        _report(name, runs[name])
    if "baseline" in runs:
        for kind in ("cli", "api", "llm", "api_import"):
            if kind not in runs["current"]:
                continue
            ratios = [b / c for b, c in zip(runs["baseline"][kind], runs["current"][kind], strict=True)]
            print(f"baseline / current, {kind}: {med(ratios):.2f}x (per round: "
                  f"{', '.join(f'{r:.2f}' for r in ratios)})")
    print(f"{args.repeats} rounds, contenders interleaved; threads {args.threads or 'torch default'}, "
          f"{os.cpu_count()} CPUs; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")


if __name__ == "__main__":
    main()
