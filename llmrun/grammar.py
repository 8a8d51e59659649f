"""Structured output: every token the model emits is one the grammar allows.

xgrammar does the grammar work: it compiles a JSON schema, a regex or an EBNF/GBNF grammar against the
vocabulary once, with the masks of context-independent tokens precomputed, then a `GrammarMatcher` follows one
reply and fills the (V,) bitmask of allowed next tokens in microseconds. We apply that mask to the logits before
sampling, so sampling, penalties and speculative verification all see the constrained distribution.

Jump-forward: where the grammar admits exactly one continuation (`name": "` after `{"` in a schema with one
required key), its text is tokenized and proposed as draft tokens, verified in the same forward pass that runs
them (`llmrun.speculative.verify`). The tokens the model agrees with cost no forward pass of their own; where the
model would have split the forced text into other tokens, its own token wins and the rest of the text is
proposed again. So the output is exactly what plain constrained decoding gives (temperature 0), or has its
distribution (temperature > 0), whatever the tokenizer does at the boundaries.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llmrun.errors import LlmrunError, UsageError, check_utf8, parse_json, read_stdin, read_text_file
from llmrun.grammar_checks import (JUMP_FORWARD_MAX, check_counts, endless_rule, forced_bound, read_rules,
                                   schema_patterns, schema_warnings)

if TYPE_CHECKING:
    import torch

ANY_JSON = "any"  # --json-schema value for "any valid JSON value"


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # "json" (a JSON schema, or ANY_JSON), "regex" or "ebnf"
    source: str  # the schema text, the pattern, or the grammar text
    origin: str  # where it came from, for messages: a file name, "stdin", "--regex"

    def describe(self) -> str:
        if self.kind == "json":
            return "any JSON" if self.source == ANY_JSON else f"JSON schema {self.origin}"
        return f"regex {self.source!r}" if self.kind == "regex" else f"grammar {self.origin}"


def grammar_spec(json_schema: str | None = None, regex: str | None = None, grammar: str | None = None) -> GrammarSpec | None:
    """The constraint the CLI options ask for, with files and stdin read. `json_schema`: a file, '-' (stdin),
    inline JSON (`{...}`, or what is not a file and parses: `true`) or ANY_JSON; `grammar`: an EBNF/GBNF file or
    '-'."""
    given = [name for name, value in (("--json-schema", json_schema), ("--regex", regex), ("--grammar", grammar)) if value is not None]
    if len(given) > 1:
        raise UsageError(f"{' and '.join(given)} each constrain the output; pass one of them")
    if json_schema is not None:
        if json_schema == ANY_JSON:
            return GrammarSpec("json", ANY_JSON, "any")
        if json_schema.lstrip().startswith("{") or (json_schema != "-" and not _is_file(json_schema) and (
                json_schema.lstrip().startswith("[") or _is_json(json_schema))):
            text, origin = json_schema, "(inline)"
        else:
            text, origin = _read("--json-schema", json_schema), json_schema
        check_utf8(text, f"--json-schema {origin}")
        try:
            schema = parse_json(text)
        except ValueError as e:
            raise LlmrunError(f"--json-schema {origin} is not valid JSON: {e}") from None
        if not _all_finite(schema):  # (Python's parser reads 1e400 as inf, and NaN; xgrammar's refuses both)
            raise LlmrunError(f"--json-schema {origin} holds a number that is not finite (NaN, Infinity, or past"
                              " a double's range such as 1e400)")
        return GrammarSpec("json", text, origin)
    if regex is not None:
        if not regex:
            raise UsageError("--regex is empty; give a pattern the whole output must match")
        check_utf8(regex, "--regex")
        return GrammarSpec("regex", regex, "--regex")
    if grammar is not None:
        text = _read("--grammar", grammar)
        check_utf8(text, f"--grammar {grammar}")
        return GrammarSpec("ebnf", text, grammar)
    return None


def _is_json(text: str) -> bool:
    try:
        parse_json(text)
    except ValueError:
        return False
    return True


def _all_finite(value) -> bool:
    todo = [value]
    while todo:
        value = todo.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if isinstance(value, dict):
            todo.extend(value.values())
        elif isinstance(value, list):
            todo.extend(value)
    return True


def _is_file(name: str) -> bool:
    try:
        return Path(name).is_file()
    except OSError:  # a name too long for the system (inline JSON mistaken for a file name)
        return False


def _read(option: str, name: str) -> str:
    if name == "-":
        if sys.stdin.isatty():
            raise LlmrunError(f"{option} - reads stdin, but stdin is a terminal; pipe the text in or name a file")
        return read_stdin()
    return read_text_file(Path(name), f"{option} {name}")  # (a pipe works too: --grammar <(...))


class Grammar:
    """A grammar compiled for one tokenizer; `start()` gives the state for one reply."""

    def __init__(self, spec: GrammarSpec, compiled, vocab_size: int, jump_forward: bool = True,
                 warnings: tuple[str, ...] = ()):
        self.spec = spec
        self.compiled = compiled
        self.warnings = warnings  # what is not enforced (a keyword, an anchor), for the user
        self.vocab_size = vocab_size
        self.jump_forward = jump_forward
        self.luts: dict = {}  # device -> (256, 8) fp32 additive masks, shared by every reply (`Constraint.apply`)

    def start(self) -> Constraint:
        return Constraint(self)


def compile_grammar(spec: GrammarSpec, tokenizer, vocab_size: int, jump_forward: bool = True) -> Grammar:
    """Compile `spec` against the tokenizer's vocabulary, padded to the model's `vocab_size` logits.

    JSON comes out compact and on one line (', ' and ': ' separators, no free whitespace): a format the
    grammar fixes is one jump-forward can fill in, and a model cannot stall the reply in endless whitespace.
    """
    xgr = _xgrammar()
    # One thread: a compile takes milliseconds, and a pool of xgrammar threads fighting the decode kernels' own
    # threads for the cores measured 100x slower decoding on a 2-core machine.
    compiler = xgr.GrammarCompiler(tokenizer_info(tokenizer, vocab_size), max_threads=1)
    document = parse_json(spec.source) if spec.kind == "json" and spec.source != ANY_JSON else None  # (read once)
    try:  # (xgrammar would read a count past 2^31 - 1 modulo 2^32, and enforce that)
        if spec.kind == "json":
            for pattern in schema_patterns(document) if document is not None else ():
                check_counts(pattern, "regex")
        else:
            check_counts(spec.source, spec.kind)
    except ValueError as e:
        raise LlmrunError(f"{spec.describe()}: {e}") from None
    said: list[str] = []
    try:
        with _stderr_lines(said):
            if spec.kind == "json":
                schema = "{}" if spec.source == ANY_JSON else spec.source
                compiled = compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "))
            elif spec.kind == "regex":
                compiled = compiler.compile_regex(spec.source)
            else:
                compiled = compiler.compile_grammar(spec.source)
    except RuntimeError as e:
        message = _xgrammar_message(e)
        if "additional properties aren't allowed" in message:  # the schema did not say so: strict mode did
            message += " (a schema's objects get only the properties it lists, unless additionalProperties allows more)"
        raise LlmrunError(f"{spec.describe()}: {message}") from None
    except UnicodeDecodeError:  # xgrammar's message quoted part of a character
        raise LlmrunError(f"{spec.describe()}: does not compile (xgrammar's message about it is not text)") from None
    warnings = [f"{m.group(1)} (not enforced)" for line in said if (m := re.search(r"Warning: (.*)", line))]
    if document is not None:
        warnings += [f"{w} (not enforced)" for w in schema_warnings(document)]
    try:
        rules = read_rules(str(compiled.grammar))  # (parsed once for both checks)
        endless, longest = endless_rule(rules), forced_bound(rules)
    except (ValueError, RecursionError):  # a form of xgrammar's printout this reading does not know (or nested past
        # Python's recursion limit): no proof the forced text ends
        endless, longest, jump_forward = None, 0, False
        warnings.append("jump-forward is off for this constraint: llmrun could not read its compiled rules")
    if jump_forward and longest > JUMP_FORWARD_MAX:  # xgrammar's search would build the whole run every step
        jump_forward = False
        warnings.append(f"jump-forward is off for this constraint: it can force up to {longest:,} characters in a"
                        f" row, which the search for them would build whole at every step")
    if endless is not None:
        what = "JSON value" if spec.kind == "json" else "text"
        if endless == "root":
            raise LlmrunError(f"{spec.describe()} matches no {what} of finite length: every way through it runs into"
                              " a recursion with no way out")
        raise LlmrunError(f"{spec.describe()}: its rule {endless} matches no {what} of finite length (every way"
                          " through it runs into a recursion with no way out), so a reply that took it could never end")
    grammar = Grammar(spec, compiled, vocab_size, jump_forward, tuple(dict.fromkeys(warnings)))
    if spec.kind == "json" and not _starts_with_text(grammar, tokenizer):  # `{"anyOf": []}`: only the empty reply
        raise LlmrunError(f"{spec.describe()} matches no JSON value")
    return grammar


def _starts_with_text(grammar: Grammar, tokenizer) -> bool:
    """Some token other than a stop token may begin the reply."""
    bitmask, _ = grammar.start().masks([])
    allowed = sum(bin(word & 0xFFFFFFFF).count("1") for word in bitmask[0].tolist())
    return allowed > sum(_allowed(bitmask[0], i) for i in tokenizer.eos_ids if i < grammar.vocab_size)


@contextlib.contextmanager
def _stderr_lines(lines: list[str]):
    """Collect into `lines` what is written to file descriptor 2 meanwhile: xgrammar's C++ writes its warnings
    there (a keyword or an anchor it ignores), as raw log lines."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            lines += f.read().decode("utf-8", "replace").splitlines()


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise LlmrunError(f"structured output needs the xgrammar package ({e}); install it: pip install xgrammar") from None
    return xgrammar


def _xgrammar_message(e: Exception) -> str:
    """xgrammar's first line without its '[time] /project/cpp/file.cc:123: ' prefix."""
    line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return re.sub(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?", "", line)


def tokenizer_info(tokenizer, vocab_size: int):
    """The vocabulary as xgrammar reads it: every token's text in the tokenizer's own encoding (byte-level 'Ġ'
    pieces, SentencePiece '▁' pieces with <0xNN> bytes, or the text itself). Control tokens become empty entries,
    which xgrammar treats as special: never allowed inside the grammar's text, whatever their spelling."""
    xgr = _xgrammar()
    vocab = tokenizer.vocabulary()
    encoded = [""] * max(vocab_size, max(vocab.values()) + 1)
    for text, i in vocab.items():
        encoded[i] = text
    for i in tokenizer.special_ids():
        encoded[i] = ""
    kind = {"bpe": xgr.VocabType.BYTE_LEVEL, "spm": xgr.VocabType.BYTE_FALLBACK, "raw": xgr.VocabType.RAW}[tokenizer.kind]
    stops = sorted(i for i in tokenizer.eos_ids if i < vocab_size)
    return xgr.TokenizerInfo(encoded[:vocab_size], kind, vocab_size=vocab_size, stop_token_ids=stops,
                             add_prefix_space=tokenizer.kind == "spm")


class Constraint:
    """The grammar's state along one reply: the tokens taken so far, the masks of what may come next.

    `seconds` adds up the time spent in grammar work (masks, accepting, rolling back), for the mask overhead
    figure."""

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self._xgr = _xgrammar()
        self.matcher = self._xgr.GrammarMatcher(grammar.compiled)
        self.seconds = 0.0

    @property
    def finished(self) -> bool:
        """The grammar has ended (its stop token was taken): nothing more may follow."""
        return self.matcher.is_terminated()

    def accept(self, token: int) -> None:
        t0 = time.perf_counter()
        ok = self.matcher.accept_token(token)
        self.seconds += time.perf_counter() - t0
        if not ok:  # the masks make this impossible; reaching it is a bug, not bad input
            raise RuntimeError(f"token {token} is not allowed by the grammar here")

    def rollback(self, n: int) -> None:
        if n:
            t0 = time.perf_counter()
            self.matcher.rollback(n)
            self.seconds += time.perf_counter() - t0

    def masks(self, drafts: list[int]) -> tuple[torch.Tensor, int]:
        """The bitmasks (T, W) int32 of the allowed tokens after the current state and after each draft token
        in turn, stopping at the first draft token the grammar does not allow; returns them and how many
        drafts passed. The state is left where it was."""
        t0 = time.perf_counter()
        bitmask = self._xgr.allocate_token_bitmask(len(drafts) + 1, self.grammar.vocab_size)
        self.matcher.fill_next_token_bitmask(bitmask, 0)
        if not bool(bitmask[0].any()):
            raise LlmrunError(f"{self.grammar.spec.describe()} allows nothing to follow here (the reply took a branch"
                              " that matches no text)")
        n = 0
        while n < len(drafts) and _allowed(bitmask[n], drafts[n]) and self.matcher.accept_token(drafts[n]):
            n += 1
            if self.matcher.is_terminated():  # a stop token: the reply ends there, the row after it is moot
                bitmask[n] = -1
                break
            self.matcher.fill_next_token_bitmask(bitmask, n)
            if not bool(bitmask[n].any()):  # a dead end (a branch that matches nothing): refuse the draft into it
                self.matcher.rollback(1)
                n -= 1
                break
        self.matcher.rollback(n)
        self.seconds += time.perf_counter() - t0
        return bitmask[: n + 1], n

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """logits (V,) or (T, V), bitmask (W,) or (T, W): the logits with disallowed tokens at -inf (a new
        tensor; the model's logits may be a view of its output buffer)."""
        import torch

        t0 = time.perf_counter()
        squeeze, vocab = logits.dim() == 1, self.grammar.vocab_size
        logits = logits.float().reshape(-1, logits.shape[-1])
        lut = self.grammar.luts.get(logits.device)
        if lut is None:  # byte value -> the additive mask (0 or -inf) of its 8 tokens, lowest bit first
            bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
            lut = self.grammar.luts[logits.device] = torch.zeros(256, 8).masked_fill(bits == 0, float("-inf")).to(logits.device)
        # A table lookup and an add: 6x faster on a CPU than a masked fill of the same (T, V).
        rows = bitmask.reshape(logits.shape[0], -1).to(logits.device).view(torch.uint8)
        additive = lut.index_select(0, rows.reshape(-1).int()).view(logits.shape[0], -1)  # (T, 32 W)
        if logits.shape[-1] == vocab:
            out = logits + additive[:, :vocab]
        else:  # a draft model with padded embedding rows: those are never text
            n = min(vocab, logits.shape[-1])
            out = torch.full_like(logits, float("-inf"))
            torch.add(logits[:, :n], additive[:, :n], out=out[:, :n])
        self.seconds += time.perf_counter() - t0
        return out[0] if squeeze else out

    def constrain(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (V,) masked by what the grammar allows next."""
        bitmask, _ = self.masks([])
        return self.apply(logits, bitmask[0])

    def forced_tokens(self, tokenizer, limit: int) -> list[int]:
        """Jump-forward: when the grammar admits only one continuation, its tokens (at most `limit`)."""
        if not self.grammar.jump_forward or limit <= 0:
            return []
        t0 = time.perf_counter()
        try:
            text = self.matcher.find_jump_forward_string()
        except UnicodeDecodeError:  # the state is inside a character (its first bytes sampled): nothing to force
            text = ""
        # Only the text `limit` tokens can spell is tokenized: a forced run can be millions of characters
        # (`"ab"{3000000}`), which took seconds a step to tokenize whole. The last tokens of a cut may differ
        # from the whole text's; verification takes the model's own tokens there, as at any boundary.
        text = text[: (limit + 1) * tokenizer.longest_token]
        self.seconds += time.perf_counter() - t0
        return tokenizer.encode(text, special=False, add_bos=False)[:limit] if text else []


def _allowed(bitmask_row: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask_row[token // 32]) >> (token % 32)) & 1)
