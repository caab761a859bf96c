"""The default model with its GGUF quantization kept (int4 kernels) against two references.

* The same weights dequantized to float32 (our float32 path, which is identical to transformers):
  greedy tokens agree for 16 new tokens except where the float32 path's top two logits are
  within the quantized path's rounding (bfloat16 activations); such near ties are reported.
* llama.cpp (``llama-cpp-python``) on the same file, when it is installed: equal tokens up to
  where llama.cpp's Q4_1 path parts from its own F32 path on the same weights (it rounds
  activations to 8 bits, which flips near ties: reported), and equal to llama.cpp's F32 path
  except near ties.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer.runtime.loading.model_loader import load_model
from deepinfer.runtime.worker.model_runner import ModelRunner

N_NEW = 16
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,",
           "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n"]
NEAR_TIE = 0.15  # logit gap under which a different greedy pick is a near tie, not a failure
# With the prompt on the native kernels too (8-bit activations per 32, as llama.cpp rounds them:
# CPUs below AVX-512, worker.native_decode.native_prompt_rows) ties flip as llama.cpp's own Q4_1
# path flips them against its F32 path: at gap 0.33 on token 5 of "The capital of France is".
NEAR_TIE_INT8_PROMPTS = 0.35


def greedy(runner: ModelRunner, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy continuation through ModelRunner (one sequence), with each step's top-2 logit gap."""
    bs = runner.block_size
    table = np.arange(1, 1 + (len(prompt) + n + bs - 1) // bs)[None, :]
    ids, out, gaps = list(prompt), [], []
    start = 0
    for _ in range(n):
        new = ids[start:]
        pos = np.arange(start, len(ids))
        slots = table[0][pos // bs] * bs + pos % bs
        logits = runner.execute(input_ids=np.array(new), positions=pos, slot_mapping=slots,
                                query_start_loc=np.array([0, len(new)]), seq_lens=np.array([len(ids)]),
                                block_tables=table, logits_indices=np.array([len(new) - 1]))[0]
        top = torch.topk(logits, 2).values
        gaps.append(float(top[0] - top[1]))
        tok = int(logits.argmax())
        start = len(ids)
        ids.append(tok)
        out.append(tok)
    return out, gaps


@pytest.fixture(scope="module")
def runners(default_gguf):
    def make(keep_quantized: bool) -> ModelRunner:
        loaded = load_model(default_gguf, device=torch.device("cpu"), dtype=torch.float32,
                            keep_quantized=keep_quantized, max_positions=256)
        return ModelRunner(loaded, num_blocks=16, block_size=16, device=torch.device("cpu"), dtype=torch.float32)
    return make(True), make(False)


def _compare(ours: list[int], ref: list[int], ref_gaps: list[float], what: str,
             near_tie: float = NEAR_TIE) -> str | None:
    """None when equal; a note when they part at a near tie; an assertion error otherwise."""
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a != b:
            assert ref_gaps[i] < near_tie, f"{what}: token {i} differs ({a} vs {b}), gap {ref_gaps[i]:.3f}"
            return f"{what}: near tie at token {i} (gap {ref_gaps[i]:.3f})"
    return None


def test_quantized_layers_are_in_use(runners):
    from deepinfer.runtime.models.quantized import Int4Linear, Q8Embedding

    quant = runners[0].model
    assert isinstance(quant.layers[0].gate_up_proj, Int4Linear)  # Q4_1 in the file
    assert isinstance(quant.quantized_head, Int4Linear) and quant.quantized_head.num_parts == 2  # Q8_0
    assert isinstance(quant.embed_tokens, Q8Embedding)


def test_greedy_tokens_match_the_dequantized_float32_path(runners, tokenizer):
    quant, dense = runners
    notes = []
    for text in PROMPTS:
        prompt = tokenizer(text).input_ids
        ours, _ = greedy(quant, prompt, N_NEW)
        ref, gaps = greedy(dense, prompt, N_NEW)
        note = _compare(ours, ref, gaps, repr(text), NEAR_TIE_INT8_PROMPTS if quant.native_prompt_rows else NEAR_TIE)
        if note:
            notes.append(note)
    # at most one prompt may part at a near tie (two with 8-bit prompt activations: measured 0.22
    # on "The capital of France is", 0.14 on "def fibonacci(n):")
    assert len(notes) <= (2 if quant.native_prompt_rows else 1), notes
    print("near ties vs float32:", notes or "none")


def llama_cpp_greedy(llama_cpp, path: str, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    llm = llama_cpp.Llama(model_path=path, n_ctx=128, n_threads=1, logits_all=True, verbose=False)
    llm.eval(prompt)
    out, gaps = [], []
    for _ in range(n):
        logits = np.asarray(llm.scores[llm.n_tokens - 1])
        top2 = np.sort(logits)[-2:]
        out.append(int(logits.argmax()))
        gaps.append(float(top2[1] - top2[0]))
        llm.eval([out[-1]])
    return out, gaps


def test_greedy_tokens_match_llama_cpp(runners, tokenizer, default_gguf, tmp_path):
    """Against llama.cpp on the same Q4_1 file up to where llama.cpp's own rounding flips a
    token (its Q4_1 path parts from its F32 path on the same weights: reported), and against
    llama.cpp's F32 path for all 16 tokens except near ties."""
    import ctypes

    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (llama.cpp) is not installed")
    f32 = str(tmp_path / "f32.gguf")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize = llama_cpp.LLAMA_FTYPE_ALL_F32, True
    assert llama_cpp.llama_model_quantize(default_gguf.encode(), f32.encode(), ctypes.byref(params)) == 0
    notes = []
    for text in PROMPTS:
        prompt = tokenizer(text).input_ids
        ours, _ = greedy(runners[0], prompt, N_NEW)
        lq, _ = llama_cpp_greedy(llama_cpp, default_gguf, prompt, N_NEW)
        lf, lf_gaps = llama_cpp_greedy(llama_cpp, f32, prompt, N_NEW)
        own_flip = next((i for i in range(N_NEW) if lq[i] != lf[i]), N_NEW)
        assert ours[:own_flip] == lq[:own_flip], f"{text!r}: differs from llama.cpp before its own flip"
        if own_flip < N_NEW:
            notes.append(f"{text!r}: llama.cpp Q4_1 parts from llama.cpp F32 at token {own_flip}")
        note = _compare(ours, lf, lf_gaps, f"{text!r} vs llama.cpp F32",
                        NEAR_TIE_INT8_PROMPTS if runners[0].native_prompt_rows else NEAR_TIE)
        if note:
            notes.append(note)
    print("llama.cpp near ties:", notes or "none")
