"""Options shared by several commands, defined once.

`@run_options` adds the sampling and runtime options to a command's signature (Typer reads
`__signature__`) and hands them to it as one `RunOptions` value; every command that generates gets the
same flags, help and validation.
"""

import functools
import inspect
import math
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Optional

import typer

from llmrun.bench import MAX_THREADS
from llmrun.catalog import complete_model
from llmrun.errors import LlmrunError, UsageError, check_utf8
from llmrun.grammar import ANY_JSON, grammar_spec
from llmrun.loading import DEFAULT_MODEL

SAMPLING = "Sampling"
RUNTIME = "Runtime"
SPECULATIVE = "Speculative decoding"
STRUCTURED = "Structured output"
KV = "KV cache"
NGRAM_DEFAULT = 3  # `--ngram` without a value
MIN_TEMPERATURE = 1e-4  # below, logits / temperature can overflow fp32 (1e-38: inf, then NaN probabilities)
PENALTY_RANGE = 1e4  # --repetition-penalty within [1 / PENALTY_RANGE, PENALTY_RANGE], for the same reason


def check_temperature(temperature: float) -> None:
    """Refuse a temperature that is not a number at least 0, or above 0 but too small to divide logits by in fp32
    (every command that samples). (Typer's own range check would call NaN "not greater than or equal to 0".)"""
    if not math.isfinite(temperature):
        raise typer.BadParameter("must be a finite number", param_hint="'--temperature'")
    if temperature < 0:
        raise typer.BadParameter(f"{temperature:g} is below 0: 0 means greedy, above 0 samples",
                                 param_hint="'--temperature'")
    if 0.0 < temperature < MIN_TEMPERATURE:
        raise typer.BadParameter(f"{temperature:g} is too small to sample with: 0 means greedy, and sampling takes at"
                                 f" least {MIN_TEMPERATURE:g}", param_hint="'--temperature'")


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class DType(str, Enum):
    auto = "auto"
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


class KVFormat(str, Enum):
    auto = "auto"
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"
    int8 = "int8"
    int4 = "int4"


class KVEvict(str, Enum):
    window = "window"
    h2o = "h2o"


class Weights(str, Enum):
    auto = "auto"
    dequant = "dequant"
    int4 = "int4"


ModelArg = Annotated[
    str,
    typer.Argument(
        help=f"Model: the alias '{DEFAULT_MODEL}' (embedded), a .gguf file, an HF model directory, or a hub id (org/name).",
        show_default=True,
        autocompletion=complete_model,
    ),
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print the result as one JSON object on stdout, and nothing else there (stderr keeps its lines).")]


@dataclass(frozen=True)
class RunOptions:
    params: object  # llmrun.sampling.SamplingParams
    device: str
    dtype: str
    ctx: int | None
    weights: str = "auto"
    threads: int | None = None
    draft: str | None = None  # speculative decoding: a draft model, or "self"
    ngram: int | None = None  # ... or prompt lookup with n-grams up to this long
    draft_tokens: int = 8  # the most draft tokens per step
    adaptive: bool = True  # choose K per step (and turn drafting off when it does not pay)
    grammar: object = None  # structured output: a llmrun.grammar.GrammarSpec
    jump_forward: bool = True  # propose the text a grammar forces instead of sampling it token by token
    kv: str | None = None  # KV cache format (None: the compute dtype)
    eviction: object = None  # a llmrun.kv_cache.Eviction: a bounded KV cache


def _complete_draft(incomplete: str) -> list[tuple[str, str] | str]:
    drafts = [("self", "a 4-bit copy of the target"), ("self:skip", "the target with layers skipped")]
    return [d for d in drafts if d[0].startswith(incomplete)] + complete_model(incomplete)


_SAMPLING = [
    ("temperature", float, 0.8, typer.Option(help="Sampling temperature; 0 means greedy.", rich_help_panel=SAMPLING)),
    ("top_k", int, 40, typer.Option(min=0, help="Keep only the K most likely tokens (0: off).", rich_help_panel=SAMPLING)),
    ("top_p", float, 0.95, typer.Option(help="Nucleus sampling, in (0, 1]: keep the smallest set reaching this probability (1: off).", rich_help_panel=SAMPLING)),
    ("min_p", float, 0.05, typer.Option(help="Drop tokens below MIN_P x the top token's probability (0: off).", rich_help_panel=SAMPLING)),
    ("repetition_penalty", float, 1.0, typer.Option(help="Penalty > 1 for tokens already in the context (1: off).", rich_help_panel=SAMPLING)),
    ("seed", Optional[int], None, typer.Option(min=0, max=2**64 - 1, help="Random seed: the same seed gives the same output.", rich_help_panel=SAMPLING)),
    ("max_new_tokens", int, 512, typer.Option("--max-new-tokens", "-n", min=1, help="Most tokens to generate per reply.", rich_help_panel=SAMPLING)),
    ("stop", Optional[list[str]], None, typer.Option(help="Stop before this string (repeatable).", rich_help_panel=SAMPLING)),
]
_STRUCTURED = [
    ("json_schema", Optional[str], None, typer.Option(metavar="FILE|-|JSON", help=f"Constrain the output to JSON valid under this schema: a file, '-' for stdin, or the schema itself; bare --json-schema (or '{ANY_JSON}'): any JSON value. The JSON comes compact, on one line.", rich_help_panel=STRUCTURED)),
    ("regex", Optional[str], None, typer.Option(metavar="PATTERN", help="Constrain the output to match this regular expression.", rich_help_panel=STRUCTURED)),
    ("grammar", Optional[str], None, typer.Option(metavar="FILE|-", help="Constrain the output to this EBNF / GBNF grammar (rule 'root' starts it).", rich_help_panel=STRUCTURED)),
    ("jump_forward", bool, True, typer.Option("--jump-forward/--no-jump-forward", help="Where the grammar allows only one continuation, propose its tokens all at once and verify them in one forward pass (same output, fewer steps).", rich_help_panel=STRUCTURED)),
]
_RUNTIME = [
    ("device", Device, Device.auto, typer.Option(help="Where to run: cuda when available, else cpu.", rich_help_panel=RUNTIME)),
    ("dtype", DType, DType.auto, typer.Option(help="Compute dtype (auto: bf16 on GPU, fp32 on CPU).", rich_help_panel=RUNTIME)),
    ("weights", Weights, Weights.auto, typer.Option(help="auto: keep a quantized file packed and run it with llmrun's kernels where they exist; dequant: expand the weights to --dtype and run plain PyTorch; int4: also round the float matrices to 4-bit blocks of 32 at load (Q4_1's scheme; W4A16 on CUDA).", rich_help_panel=RUNTIME)),
    ("threads", Optional[int], None, typer.Option(min=1, max=MAX_THREADS, help="CPU threads (default: PyTorch's choice, one per core).", rich_help_panel=RUNTIME)),
    ("ctx", Optional[int], None, typer.Option(min=16, help="Context length in tokens (default: the model's, at most 8192; for eval, the window: 512).", rich_help_panel=RUNTIME)),
    ("kv", KVFormat, KVFormat.auto, typer.Option(help="KV cache format: auto (the compute dtype), fp32/bf16/fp16, int8 (per token, 8.5 bits), int4 (KIVI: keys per channel, values per token, 5 bits). Attention reads the quantized cache directly.", rich_help_panel=KV)),
    ("kv_evict", Optional[KVEvict], None, typer.Option(help="Bound the KV cache to --kv-budget tokens: window keeps --kv-sinks first tokens and the most recent (StreamingLLM); h2o also keeps the tokens that got the most attention (H2O). The conversation may then grow past the context.", rich_help_panel=KV)),
    ("kv_budget", Optional[int], None, typer.Option(min=1, help="Tokens an evicting cache holds (with --kv-evict).", rich_help_panel=KV)),
    ("kv_sinks", Optional[int], None, typer.Option(min=0, help="First tokens an evicting cache always keeps (attention sinks; default: 4).", rich_help_panel=KV, show_default=False)),
]
_SPECULATIVE = [
    ("draft", Optional[str], None, typer.Option(help="Speculative decoding with a draft model that shares the target's tokenizer (a .gguf, HF directory or hub id), or 'self': a 4-bit copy of the target ('self:skip': the target with layers skipped).", rich_help_panel=SPECULATIVE, autocompletion=_complete_draft)),
    ("ngram", Optional[int], None, typer.Option(help=f"Speculative decoding by prompt lookup: propose what followed the latest earlier match of the last N tokens (bare --ngram: {NGRAM_DEFAULT}). No extra model; best when the reply copies from the prompt.", rich_help_panel=SPECULATIVE)),
    ("draft_tokens", int, 8, typer.Option(min=1, max=32, help="Most draft tokens verified per step (K).", rich_help_panel=SPECULATIVE)),
    ("adaptive", bool, True, typer.Option("--adaptive/--fixed-k", help="Choose K each step from the measured acceptance and costs, drafting nothing when it does not pay; --fixed-k always drafts --draft-tokens.", rich_help_panel=SPECULATIVE)),
]
_DEFAULTS = {name: default for name, _, default, _ in _SPECULATIVE}
DEFAULT_CTX_CAP = 8192  # a 128k-context model would otherwise preallocate gigabytes of KV cache


def _build(values: dict) -> RunOptions:
    from llmrun.sampling import SamplingParams

    speculative = {name: values[name] for name, *_ in _SPECULATIVE if name in values}
    if "draft" in values:
        if values["draft"] is not None and not values["draft"].strip():
            raise typer.BadParameter("is empty; give a model, or 'self'", param_hint="'--draft'")
        if values["draft"] is None and values["ngram"] is None:  # tuning options of a drafter that is not there
            for name, flag in (("draft_tokens", "--draft-tokens"), ("adaptive", "--fixed-k")):
                if values[name] != _DEFAULTS[name]:
                    raise typer.BadParameter("has no effect without a drafter: add --ngram or --draft", param_hint=f"'{flag}'")
    speculative.update(kv=None if values["kv"] is KVFormat.auto else values["kv"].value, eviction=_eviction(values))
    if "temperature" not in values:  # a command without sampling options
        return RunOptions(None, values["device"].value, values["dtype"].value, values["ctx"],
                          values["weights"].value, values["threads"], **speculative)
    check_temperature(values["temperature"])
    for name in ("top_p", "min_p", "repetition_penalty"):
        if not math.isfinite(values[name]):
            raise typer.BadParameter("must be a finite number", param_hint=f"'--{name.replace('_', '-')}'")
    if not 0.0 <= values["min_p"] <= 1.0:
        raise typer.BadParameter("must be in [0, 1] (0: off)", param_hint="'--min-p'")
    if not 0.0 < values["top_p"] <= 1.0:
        raise typer.BadParameter("must be in (0, 1]", param_hint="'--top-p'")
    if not 1 / PENALTY_RANGE <= values["repetition_penalty"] <= PENALTY_RANGE:  # beyond, logits overflow or vanish
        raise typer.BadParameter(f"must be between {1 / PENALTY_RANGE:g} and {PENALTY_RANGE:g} (1: off)",
                                 param_hint="'--repetition-penalty'")
    if "" in (values["stop"] or ()):
        raise typer.BadParameter("an empty stop string would stop before the first token", param_hint="'--stop'")
    for stop in values["stop"] or ():  # (text that is not UTF-8 could never match)
        try:
            check_utf8(stop, "it")
        except LlmrunError as e:
            raise typer.BadParameter(str(e), param_hint="'--stop'") from None
    params = SamplingParams(
        temperature=values["temperature"], top_k=values["top_k"], top_p=values["top_p"], min_p=values["min_p"],
        repetition_penalty=values["repetition_penalty"], seed=values["seed"],
        max_new_tokens=values["max_new_tokens"], stop=tuple(values["stop"] or ()),
    )
    grammar = grammar_spec(values["json_schema"], values["regex"], values["grammar"])
    return RunOptions(params, values["device"].value, values["dtype"].value, values["ctx"],
                      values["weights"].value, values["threads"], **speculative, grammar=grammar,
                      jump_forward=values["jump_forward"])


def _eviction(values: dict):
    if values["kv_evict"] is None:
        for flag in ("kv_budget", "kv_sinks"):
            if values[flag] is not None:
                raise typer.BadParameter("needs --kv-evict window or h2o (which tokens to drop)",
                                         param_hint=f"'--{flag.replace('_', '-')}'")
        return None
    if values["kv_budget"] is None:
        raise typer.BadParameter("needs --kv-budget N (how many tokens the cache keeps)", param_hint="'--kv-evict'")
    from llmrun.kv_cache import Eviction

    sinks = {} if values["kv_sinks"] is None else {"sinks": values["kv_sinks"]}
    return Eviction(values["kv_evict"].value, values["kv_budget"], **sinks)


def expand_bare_options(argv: list[str]) -> list[str]:
    """Options whose value is optional: a bare `--ngram` (not followed by a number) means N = 3; a bare
    `--json-schema` (followed by another option, or last) means any JSON."""
    out = []
    for i, arg in enumerate(argv):
        following = argv[i + 1] if i + 1 < len(argv) else None
        if arg == "--ngram" and not (following is not None and _looks_numeric(following)):  # (1.5: typer says why not)
            arg = f"--ngram={NGRAM_DEFAULT}"
        elif arg == "--json-schema" and (following is None or (following.startswith("-") and following != "-")):
            arg = f"--json-schema={ANY_JSON}"
        out.append(arg)
    return out


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def run_options(command=None, *, sampling: bool = True, speculative: bool | None = None, stdin_conflict=None):
    """Decorator: append the shared options to `command`'s CLI signature; pass them as `opts: RunOptions`.

    `@run_options(sampling=False)` adds only the runtime options (device, dtype, weights, threads, ctx); then
    `opts.params` is None. The speculative-decoding options come with the sampling ones unless `speculative`
    says otherwise. `stdin_conflict(kwargs)`: where the command's own arguments say it reads its text from stdin,
    the message for a constraint that asks for stdin too (checked before the constraint reads stdin), else None.
    """
    if command is None:
        return functools.partial(run_options, sampling=sampling, speculative=speculative, stdin_conflict=stdin_conflict)
    with_speculative = sampling if speculative is None else speculative
    table = (_SAMPLING + _STRUCTURED if sampling else []) + _RUNTIME + (_SPECULATIVE if with_speculative else [])
    sig = inspect.signature(command, eval_str=True)
    own = [p for p in sig.parameters.values() if p.name != "opts"]
    shared = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[kind, option])
        for name, kind, default, option in table
    ]

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        values = {name: kwargs.pop(name) for name, *_ in table}
        if stdin_conflict is not None and "-" in (values.get("json_schema"), values.get("grammar")):
            if (message := stdin_conflict(kwargs)) is not None:
                raise UsageError(message)
        return command(*args, opts=_build(values), **kwargs)

    wrapper.__signature__ = sig.replace(parameters=own + shared)
    return wrapper
