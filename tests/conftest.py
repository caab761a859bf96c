"""How pytest-xdist hands out the tests when nox runs a suite on several workers (noxfile.py's
``_pytest``: ``--dist loadfile``). Nothing here changes what a test does or checks.

With ``loadfile`` a whole file goes to one worker, its tests in their order, its module fixtures
set up once; xdist hands out the files with the most tests first, so a file of a few long tests
came last and ran alone while the other worker idled. Here the units named in ``LONG`` go first,
longest first (CI durations on the 2-core machine), and the files in ``PER_TEST`` are split into
one unit per test: their tests are independent runs of a checker in a subprocess (no module
fixture, no shared state), minutes each under Triton's interpreter.
"""

from __future__ import annotations

import pytest

PER_TEST = ("tests/runtime/test_gguf_gpu.py",)

#: node-id prefixes, longest first (seconds: call + setup in a CI run with 2 workers)
LONG = (
    "tests/runtime/test_gguf_gpu.py::test_mixed_type_model_matches_its_dequantized_self",  # 350
    "tests/runtime/test_loaders.py",  # 174 in one test
    "tests/runtime/test_gguf_gpu.py::test_kernels_match_gguf_dequantization_in_float64",  # 4 x 32-102
    "tests/runtime/test_fused_kernels.py",  # 79
    "tests/runtime/test_sampling_features.py",  # 79
    "tests/runtime/test_batch_invariance.py",  # 74
    "tests/runtime/test_llm.py",  # 62 of setup
    "tests/runtime/test_cpu_prefill.py",  # 49 of setup
    "tests/runtime/test_moe_decode_kernels.py",  # 49
    "tests/runtime/test_tokenizer_cache_race.py",  # 48
    "tests/serve/test_data_parallel.py",  # ~170
    "tests/serve/test_engine_core.py",  # ~140
    "tests/serve/test_prompt_embeds_served.py",  # ~135
    "tests/serve/test_hardening.py",  # ~110
    "tests/serve/test_tool_streaming.py",  # ~100
    "tests/serve/test_deterministic_served.py",  # 42
)


def _rank(scope: str) -> int:
    return next((i for i, prefix in enumerate(LONG) if scope.startswith(prefix)), len(LONG))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LongFirstFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return nodeid if path in PER_TEST else path

        def _assign_work_unit(self, node) -> None:
            first = min(self.workqueue, key=_rank)  # min: the first of equal ranks
            self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

    return LongFirstFileScheduling(config, log)
