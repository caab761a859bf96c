"""Offline throughput of DeepInfer on random prompts: requests/s, input and output tokens/s.

    python examples/benchmark.py --num-prompts 32 --input-len 128 --output-len 64
    python examples/benchmark.py --model path/to/model --device cuda --dummy-weights

``--dummy-weights`` initialises the model's real shape randomly (for GPU throughput work: the
numbers are the same as with real weights, the text is not meaningful).
"""

from __future__ import annotations

import argparse
import sys

from deepinfer.cli.commands import add_bench_args, run_bench


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_args(parser)
    return run_bench(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
