"""Text <-> token ids for every model llmrun loads.

Every source ends up as one `tokenizers.Tokenizer`, so encoding, decoding and streaming have a single
code path:
- GGUF "gpt2" vocabularies and most HF `tokenizer.json` files: byte-level BPE;
- GGUF "llama" vocabularies and bare `tokenizer.model` files: SentencePiece-style BPE, rebuilt from the
  pieces and their scores (merge the best-scoring adjacent pair first, as SentencePiece and llama.cpp do).
"""

from __future__ import annotations

import codecs
import functools
import itertools
import json
import re
from pathlib import Path
from typing import Any, Iterable, NamedTuple

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from llmrun.chat_template import ChatTemplate
from llmrun.errors import LlmrunError, ModelFormatError, UnsupportedModelError, check_utf8, parse_json

# GGUF `tokenizer.ggml.token_type` values.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Control tokens that end a turn even when the file declares a different eos; llama.cpp stops on these
# too, so e.g. SmolLM stops on <|endoftext|> as well as on its declared eos <|im_end|>.
_END_OF_GENERATION = frozenset(
    {"<|endoftext|>", "<|end_of_text|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>"}
)

# Pre-tokenizer regexes (the split before BPE) of the Llama-3 and Qwen2 families; they differ only in
# digits: Llama-3 keeps runs of up to three, Qwen2 splits every digit.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# Qwen3.5's: Qwen2's, with a letter's combining marks part of its word
_QWEN35_SPLIT = _QWEN2_SPLIT.replace(r"\p{L}+", r"[\p{L}\p{M}]+").replace(r"[^\s\p{L}\p{N}]+", r"[^\s\p{L}\p{M}\p{N}]+")
# Mistral's Tekken (Nemo): a word is its capitals then its small letters, so camelCase splits at each capital.
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek's splits are several regexes, each splitting the pieces the one before it left: line breaks, words
# (with one space before), punctuation, CJK and Hangul runs, digits. DeepSeek LLM's words are the cased letters
# its tokenizer.json lists (not every \p{L}: CJK goes to the run after; Georgian's Mkhedruli is no word).
_CJK_RUNS = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LLM_WORD = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102"
    "\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943"
)
_DEEPSEEK_LLM_SPLITS = (
    "[\r\n]",
    f"\\s?[{_DEEPSEEK_LLM_WORD}]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    _CJK_RUNS,
    r"\p{N}+",
)
_DEEPSEEK_CODER_SPLITS = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_RUNS, r"\p{N}")


def _gpt2_byte_chars() -> dict[str, int]:
    """Byte-level BPE's alphabet: each byte as the printable character that spells it in the vocabulary (GPT-2's
    table: printable Latin-1 bytes as themselves, the other 68 as U+0100 onwards, in order) -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


_BYTE_OF_CHAR = _gpt2_byte_chars()
# What an added token's lstrip/rstrip takes: Unicode's White_Space, as the tokenizers library (Rust's
# char::is_whitespace) reads it; Python's str.strip takes U+001C-U+001F too.
_WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_SPACES_AT_START, _SPACES_AT_END = re.compile(f"[{_WHITE_SPACE}]*"), re.compile(f"[{_WHITE_SPACE}]+$")
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte-fallback piece: the byte it stands for

# Brackets around message text spelling a control token while a chat template renders
# (`Tokenizer.render_chat_spans`): the first two Unicode noncharacters (else private-use characters) in no message
_BRACKETS = (range(0xFDD0, 0xFDF0), range(0xF0000, 0xFFFFE))


class _Split(NamedTuple):
    """How a byte-level BPE vocabulary splits text before merging."""
    regexes: tuple[str, ...]  # each splits the pieces the one before it left, its matches pieces of their own
    then_gpt2: bool  # then GPT-2's own split (byte-level BPE's regex)
    llama3_like: bool  # a word that is already a whole token is taken as is, ignoring merges; BOS unless the file says


def _pre_tokenizers() -> dict[str, _Split]:
    """llama.cpp's `tokenizer.ggml.pre` names -> their split."""
    families = [
        (_Split((), True, False), "gpt-2 gpt2 default phi-2 mpt olmo jais trillion exaone4 a.x-4.0 mellum gigachat"),
        (_Split((r"\p{N}",), True, False), "smollm starcoder refact codeshell command-r exaone minerva-7b"),
        (_Split((_LLAMA3_SPLIT,), False, True),
         "llama-bpe llama3 llama-v3 falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano"),
        (_Split((_LLAMA3_SPLIT,), False, False), "smaug-bpe dbrx"),
        (_Split((_QWEN2_SPLIT,), False, False), "qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2"),
        (_Split((_QWEN35_SPLIT,), False, False), "qwen35"),
        (_Split((_TEKKEN_SPLIT,), False, True), "tekken"),
        (_Split(_DEEPSEEK_LLM_SPLITS, False, False), "deepseek-llm"),
        (_Split(_DEEPSEEK_CODER_SPLITS, False, False), "deepseek-coder"),
    ]
    return {name: split for split, names in families for name in names.split()}


_PRE_TOKENIZERS = _pre_tokenizers()


class Tokenizer:
    """Wraps a `tokenizers.Tokenizer` plus the model's special-token facts."""

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        *,
        kind: str,
        bos_id: int | None,
        eos_id: int | None,
        eos_ids: Iterable[int],
        add_bos: bool,
        chat_template: str | None,
        warnings: Iterable[str] = (),
    ):
        self._tok = tok
        # "bpe" (byte-level pieces), "spm" (SentencePiece-style: '▁' pieces, <0xNN> bytes) or "raw" (pieces spelled
        # as the text itself, e.g. WordLevel); shown by `llmrun info`, and how grammars read the vocabulary
        self.kind = kind
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = bos_id
        self.eos_id = eos_id  # the declared eos; templates see its text as `eos_token`
        self.eos_ids = frozenset(eos_ids)  # every id that ends generation
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.warnings = list(warnings)
        self._template: ChatTemplate | None = None
        control = {i: t.content for i, t in tok.get_added_tokens_decoder().items() if t.special}
        self._special = frozenset(control)  # the control tokens' ids (`special_ids`)
        # matches the text of any control token, the longest first (`render_chat_spans`); None if there is none
        texts = sorted(set(control.values()), key=len, reverse=True)
        self._control_text = re.compile("|".join(map(re.escape, texts))) if texts else None

    def encode(self, text: str, *, special: bool = False, add_bos: bool | None = None) -> list[int]:
        """special=True turns control tokens written in `text` (e.g. "<|im_start|>") into their ids;
        special=False tokenizes them as plain text, so user input cannot forge a turn boundary."""
        check_utf8(text)
        # A flag on the shared object: not safe to encode from several threads at once.
        self._tok.encode_special_tokens = not special
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def vocabulary(self) -> dict[str, int]:
        """Every token string (added tokens included) -> its id."""
        return self._tok.get_vocab(with_added_tokens=True)

    @functools.cached_property
    def longest_token(self) -> int:
        """The most characters one token spells, at most: the longest vocabulary entry (a byte-level piece has a
        character a byte, a SentencePiece `<0xNN>` six for one byte)."""
        return max(map(len, self.vocabulary()), default=1)

    def special_ids(self) -> list[int]:
        """The ids of control tokens (e.g. <|im_start|>): markup for the model, never text."""
        return sorted(self._special)

    def is_control(self, token_id: int) -> bool:
        return token_id in self._special

    def has_id(self, token_id: int) -> bool:
        """Whether the vocabulary has an entry for `token_id` (its ids may have gaps: not all below vocab_size)."""
        return self._tok.id_to_token(token_id) is not None

    def decode(self, ids: list[int], *, skip_special: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special)

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry itself (e.g. "Ġthe", "▁the", "<0x0A>"), for display and templates."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            raise LlmrunError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return piece

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, variables: dict | None = None
                    ) -> str:
        """The chat template's text of `messages`; `variables`: more of the template's variables (Qwen3's
        `enable_thinking`: `llmrun chat --chat-template-kwargs`)."""
        if self.chat_template is None:
            raise LlmrunError(
                "this model has no chat template; use `llmrun generate` with a plain prompt instead"
            )
        if self._template is None:
            self._template = ChatTemplate(self.chat_template)
        return self._template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._piece_or_empty(self.bos_id),
            eos_token=self._piece_or_empty(self.eos_id),
            **(variables or {}),
        )

    def render_chat_spans(self, messages: list[dict], add_generation_prompt: bool = True,
                          variables: dict | None = None) -> tuple[str, list[tuple[int, int]]]:
        """The rendered template and the spans (start, end) of it that are message text spelling a control token
        (a user who types "<|im_end|>"): `encode_rendered` reads those as text, so that no message can forge a
        turn boundary. Such text is bracketed by two noncharacters while the template renders, and the brackets
        then taken out; a template that does more with them than copy them (the text without them differs from
        the plain rendering) is refused."""
        pattern = self._control_text
        texts = [m["content"] for m in messages if isinstance(m.get("content"), str)]
        if pattern is None or not any(pattern.search(content) for content in texts):
            return self.render_chat(messages, add_generation_prompt, variables), []
        used = set(self.chat_template or "").union(*texts)
        free = (c for c in map(chr, itertools.chain(*_BRACKETS)) if c not in used)
        opening, closing = next(free, None), next(free, None)
        if closing is None:  # (a message holding 65,000 noncharacters and private-use characters)
            raise LlmrunError("a message spells one of the model's control tokens (e.g. <|im_end|>) and holds every "
                              "character that could mark it as text; rephrase the message")
        marked = [{**m, "content": pattern.sub(lambda x: opening + x.group(0) + closing, m["content"])}
                  if isinstance(m.get("content"), str) else m for m in messages]
        text, spans, start = "", [], None
        for piece in re.split(f"([{opening}{closing}])", self.render_chat(marked, add_generation_prompt, variables)):
            if piece == opening and start is None:
                start = len(text)
            elif piece == closing and start is not None:
                spans.append((start, len(text)))
                start = None
            elif piece in (opening, closing):
                start = -1  # unbalanced: the check below refuses it
                break
            else:
                text += piece
        if start is not None or text != self.render_chat(messages, add_generation_prompt, variables):
            raise LlmrunError("a message spells one of the model's control tokens (e.g. <|im_end|>), and this model's"
                              " chat template does not keep it apart from its own markup; rephrase the message")
        return text, spans

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode_rendered(*self.render_chat_spans(messages, add_generation_prompt))

    def encode_rendered(self, text: str, plain: Iterable[tuple[int, int]] = (), add_bos: bool | None = None
                        ) -> list[int]:
        """The ids of a rendered chat template: its control tokens parsed, but in the spans `plain` (message text,
        `render_chat_spans`) read as text; BOS added unless the text has it (add_bos None) or as add_bos says."""
        plain = list(plain)
        # Many templates write {{ bos_token }} themselves; adding another would double it.
        bos_text = self._piece_or_empty(self.bos_id)
        if add_bos is None:
            add_bos = (self.add_bos and bool(bos_text)
                       and not (text.startswith(bos_text) and not any(a == 0 for a, _ in plain)))
        if not plain:
            ids = self.encode(text, special=True, add_bos=False)
        else:  # the control tokens outside the spans as their ids; the text between them, spans and all, as text
            # (one run encoded whole, as the tokenizer splits it at control tokens: a span encoded on its own
            # would begin a word of its own, a SentencePiece "▁" before it). Each run is read as the tokenizer
            # reads text between control tokens: a token that strips the whitespace beside it (Phi-3's rstrip)
            # takes it, and only a run at the start of the text gets a Metaspace's "first" "▁".
            check_utf8(text)
            ids, at, spans = [], 0, iter(sorted(plain))
            span = next(spans, None)
            for found in self._control_text.finditer(text):  # (in order, as the spans: one pass over both)
                while span is not None and span[1] <= found.start():
                    span = next(spans, None)
                if (span is not None and span[0] <= found.start()) or found.start() < at:
                    continue
                lstrip, rstrip = self._strips.get(found.group(0), (False, False))
                run = text[at:found.start()]
                ids += self._encode_run(_SPACES_AT_END.sub("", run) if lstrip else run, first=at == 0)
                ids.append(self._tok.token_to_id(found.group(0)))
                at = found.end()
                if rstrip:
                    at = _SPACES_AT_START.match(text, at).end()
            ids += self._encode_run(text[at:], first=at == 0)
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

    def _encode_run(self, run: str, first: bool) -> list[int]:
        """The ids of `run`, text between control tokens (those it spells read as text), `first` if it begins the
        whole text."""
        tok = self._tok if first else self._after_control
        tok.encode_special_tokens = True
        return tok.encode(run, add_special_tokens=False).ids

    @functools.cached_property
    def _strips(self) -> dict[str, tuple[bool, bool]]:
        """Added token text -> whether it takes the whitespace before it, after it (lstrip, rstrip)."""
        return {t.content: (t.lstrip, t.rstrip) for t in self._tok.get_added_tokens_decoder().values()}

    @functools.cached_property
    def _after_control(self) -> tokenizers.Tokenizer:
        """The tokenizer as it reads text that follows a control token: a Metaspace whose "▁" goes before the first
        word of the text only (prepend_scheme "first", as transformers writes Llama's and Mistral's) puts none
        there. (Built at the first message that spells a control token.)"""
        doc = json.loads(self._tok.to_str())
        found = []

        def never(node):
            if isinstance(node, dict):
                if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
                    node["prepend_scheme"] = "never"
                    found.append(node)
                for value in node.values():
                    never(value)
            elif isinstance(node, list):
                for value in node:
                    never(value)

        never(doc.get("pre_tokenizer"))
        return tokenizers.Tokenizer.from_str(json.dumps(doc)) if found else self._tok

    def cut_bytes(self, ids: list[int]) -> int:
        """How many bytes at the end of what `ids` spell begin a UTF-8 character without the rest of it (0 if none),
        which `decode` shows as U+FFFD: a reply cut by its token limit there. (A token spelling U+FFFD does not.)"""
        return self._cut(ids)[0]

    def _cut(self, ids: list[int]) -> tuple[int, list[int]]:
        """(`cut_bytes`, the places in `ids` of its last ids that spell bytes: `_spelling_tail`)."""
        tail = self._spelling_tail(ids)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decoder.decode(b"".join(self._piece_bytes(ids[k]) for k in tail), final=False)
        return len(decoder.getstate()[0]), tail  # bytes held back for the rest of a character

    def without_cut_character(self, ids: list[int], text: str, skip_special: bool = False) -> str:
        """`text`, `ids` decoded (as skip_special says), less the U+FFFD of a character cut at the end (`cut_bytes`)."""
        n, tail = self._cut(ids)
        if not n or not text.endswith("\ufffd"):
            return text
        cut = tail[-n:]
        if self.kind == "spm" and all(_BYTE_PIECE.fullmatch(self.id_to_piece(ids[k])) for k in cut):
            # SentencePiece's byte fallback writes a U+FFFD for each byte of a run that is not UTF-8, a whole
            # character's before it included: decoded again without the cut bytes
            return self.decode([i for k, i in enumerate(ids) if k not in cut], skip_special=skip_special)
        return text[:-1]  # byte-level BPE: the cut bytes are one U+FFFD

    def _spelling_tail(self, ids: list[int]) -> list[int]:
        """The places in `ids` of its last (at most) 4 ids that spell bytes, in order: a character is at most 4, and
        control tokens and ids past the vocabulary spell none (looked for among the last 16)."""
        at = [k for k in range(len(ids) - 1, max(len(ids) - 16, 0) - 1, -1)
              if ids[k] not in self._special and self._piece_bytes(ids[k])]
        return at[:4][::-1]

    def _piece_bytes(self, token_id: int) -> bytes:
        piece = self._tok.id_to_token(token_id)
        if piece is None:  # past the vocabulary (a model's padded embedding rows): spells nothing, as in `decode`
            return b""
        if self.kind == "bpe" and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        if self.kind == "spm":
            byte = _BYTE_PIECE.fullmatch(piece)
            return bytes([int(byte.group(1), 16)]) if byte else piece.replace("\u2581", " ").encode()
        return piece.encode()

    def save(self, directory: Path) -> None:
        """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json and generation_config.json: the
        files `tokenizer_from_hf_dir` (and transformers) read back to this tokenizer."""
        directory = Path(directory)
        self._tok.save(str(directory / "tokenizer.json"))
        special = {f"{kind}_token": self.id_to_piece(i) for kind, i in (("bos", self.bos_id), ("eos", self.eos_id))
                   if i is not None}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "add_bos_token": self.add_bos,
                  "add_eos_token": False, "clean_up_tokenization_spaces": False}
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        generation = {"eos_token_id": sorted(self.eos_ids)} | ({} if self.bos_id is None else {"bos_token_id": self.bos_id})
        files = {"tokenizer_config.json": config, "special_tokens_map.json": special, "generation_config.json": generation}
        for name, content in files.items():
            (directory / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    def _piece_or_empty(self, token_id: int | None) -> str:
        return "" if token_id is None else self.id_to_piece(token_id)


class StreamDecoder:
    """Incremental detokenization for streaming output.

    Decoding one token at a time is wrong twice over: a byte-level token may hold half a UTF-8
    character, and SentencePiece decoders strip the space at the start of the decoded text. So we
    decode a short window `ids[prefix:]`, subtract the text of `ids[prefix:read]` (decoded the same
    way, so it loses the same leading space), and hold back while the tail is an incomplete
    character (U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._ids: list[int] = []
        self._prefix = 0  # start of the decoding window in _ids
        self._read = 0  # _ids[:_read] have been emitted

    def push(self, token_id: int) -> str:
        if self._spells_nothing(token_id):  # kept out of the window, which a long run of such ids would grow
            return ""
        self._ids.append(token_id)
        return self._emit(final=False)

    def _spells_nothing(self, token_id: int) -> bool:
        """An id with no text now or later: none of the vocabulary's, or a control token skipped (one the decoder
        skips: decoding the window with or without it gives the same text)."""
        tok = self._tokenizer
        if not tok.has_id(token_id):
            return True
        return self._skip_special and tok.is_control(token_id) and tok.decode([token_id], skip_special=True) == ""

    def flush(self) -> str:
        """Whatever is still held back once generation has ended, but for the first bytes of a character whose rest
        never came (`-n` cut it)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        decode = self._tokenizer.decode
        done = decode(self._ids[self._prefix : self._read], skip_special=self._skip_special)
        text = decode(self._ids[self._prefix :], skip_special=self._skip_special)
        if final:  # a character cut by the end of generation: its first bytes are not text
            text = self._tokenizer.without_cut_character(self._ids[self._prefix:], text, self._skip_special)
        if len(text) <= len(done) or (text.endswith("\ufffd") and not final):
            return ""
        # The emitted window becomes the next one's prefix; older ids are no longer needed.
        self._ids = self._ids[self._read :]
        self._prefix, self._read = 0, len(self._ids)
        return text[len(done) :]


# --- building from GGUF metadata -------------------------------------------------------------------


def tokenizer_from_gguf(metadata: dict[str, Any]) -> Tokenizer:
    """`metadata`: GGUF key -> plain Python value (lists for arrays)."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelFormatError("the GGUF file has no vocabulary (tokenizer.ggml.tokens is missing)")
    types = list(metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    model = metadata.get("tokenizer.ggml.model")
    warnings: list[str] = []
    if model == "gpt2":
        merges = metadata.get("tokenizer.ggml.merges") or []
        pre = metadata.get("tokenizer.ggml.pre")
        tok, add_bos_default = _byte_level_bpe(tokens, merges, pre, warnings)
        kind = "bpe"
    elif model == "llama":
        scores = metadata.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))]
        tok = _sentencepiece_bpe(
            tokens, scores, types,
            unk_id=metadata.get("tokenizer.ggml.unknown_token_id", 0),
            add_space_prefix=metadata.get("tokenizer.ggml.add_space_prefix", True),
        )
        kind, add_bos_default = "spm", True
    else:
        raise UnsupportedModelError(f"this GGUF file's tokenizer type {model!r} is not supported (only gpt2, llama)")

    _add_special_tokens(tok, tokens, types)
    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    eos_id = metadata.get("tokenizer.ggml.eos_token_id")
    declared = [eos_id] + [metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    control = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == CONTROL}
    return Tokenizer(
        tok,
        kind=kind,
        bos_id=bos_id,
        eos_id=eos_id,
        eos_ids=_end_ids(declared, control),
        add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        chat_template=_gguf_chat_template(metadata),
        warnings=warnings,
    )


def _gguf_chat_template(metadata: dict) -> str | None:
    template = metadata.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise ModelFormatError(f"the GGUF file's tokenizer.chat_template must be a string, not "
                               f"{type(template).__name__}")
    return template


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a repeated string keeps its first id
    return vocab


def _byte_level_bpe(
    tokens: list[str], merges: list[str], pre: str | None, warnings: list[str]
) -> tuple[tokenizers.Tokenizer, bool]:
    """The tokenizer and whether it adds BOS where the file does not say (as llama.cpp: Llama-3-like files do)."""
    if pre not in _PRE_TOKENIZERS:
        warnings.append("the GGUF names no pre-tokenizer (tokenizer.ggml.pre): using GPT-2's, so some ids may differ "
                        "from llama.cpp's" if pre is None else
                        f"unknown pre-tokenizer {pre!r}: using GPT-2's, so some ids may differ from llama.cpp's")
    split = _PRE_TOKENIZERS.get(pre, _PRE_TOKENIZERS["gpt-2"])
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = tokenizers.Tokenizer(models.BPE(_vocab(tokens), pairs, ignore_merges=split.llama3_like))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in split.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split.then_gpt2)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok, split.llama3_like


def _sentencepiece_bpe(
    tokens: list[str], scores: list[float], types: list[int], *, unk_id: int | None, add_space_prefix: bool
) -> tokenizers.Tokenizer:
    # SentencePiece BPE merges any adjacent pair whose concatenation is a normal piece, the highest
    # scoring piece first. As a merge list: every two-way split of every piece, ranked by that piece.
    normal = {t: i for i, t in enumerate(tokens) if types[i] == NORMAL}
    merges = []
    for piece, i in sorted(normal.items(), key=lambda item: (-scores[item[1]], item[1])):
        splits = ((piece[:k], piece[k:]) for k in range(1, len(piece)))
        merges.extend((left, right) for left, right in splits if left in normal and right in normal)
    vocab = _vocab(tokens)
    unk = tokens[unk_id] if unk_id is not None and unk_id < len(tokens) else None
    # byte_fallback: a character with no piece becomes its UTF-8 bytes as <0xNN> tokens instead of <unk>.
    byte_fallback = "<0x00>" in vocab
    tok = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=byte_fallback))
    # SentencePiece writes spaces as "▁" and (usually) puts one before the text, so "Hi" and " Hi" agree.
    space = normalizers.Replace(" ", "\u2581")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), space]) if add_space_prefix else space
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))  # undo the prefix (after Fuse: once per text)
    tok.decoder = decoders.Sequence(steps)
    return tok


def _add_special_tokens(tok: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    # Control and unknown tokens are "special": matched in text only when encode(special=True).
    # User-defined tokens are matched always, as llama.cpp and HF do (Gemma's whitespace runs are such).
    typed = list(zip(tokens, types))
    special = [AddedToken(t, special=True, normalized=False) for t, ty in typed if ty in (UNKNOWN, CONTROL)]
    tok.add_special_tokens(special)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in typed if ty == USER_DEFINED])


def _end_ids(declared: Iterable[int | None], special: dict[str, int]) -> frozenset[int]:
    ids = {i for i in declared if i is not None}
    return frozenset(ids | {i for t, i in special.items() if t in _END_OF_GENERATION})


# --- building from a Hugging Face directory --------------------------------------------------------


def tokenizer_from_hf_dir(path: Path) -> Tokenizer:
    path = Path(path)
    config = _read_json(path / "tokenizer_config.json")
    if (path / "tokenizer.json").is_file():
        try:
            tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # the Rust side raises a bare Exception for any parse error
            raise ModelFormatError(f"cannot read {path / 'tokenizer.json'}: {exc}") from None
        kind = _kind_of(tok)
    elif (path / "tokenizer.model").is_file():
        tok, kind = _from_sentencepiece_file(path / "tokenizer.model", legacy=config.get("legacy") is not False), "spm"
        _add_declared_tokens(tok, path, config)
    else:
        raise ModelFormatError(f"{path} has neither tokenizer.json nor tokenizer.model")

    def token_id(value: Any) -> int | None:  # tokenizer_config writes a token as "text" or {"content": "text"}
        text = value.get("content") if isinstance(value, dict) else value
        return tok.token_to_id(text) if isinstance(text, str) else None

    model_config = _read_json(path / "config.json")
    generation = _read_json(path / "generation_config.json")
    vocab_size = tok.get_vocab_size(with_added_tokens=True)

    def declared_ids(config: dict, file: str, key: str) -> list[int]:  # an id or a list of them; null is none
        ids = _as_list(config.get(key))
        for i in ids:
            if type(i) is not int or not 0 <= i < vocab_size:
                raise ModelFormatError(f"{path / file}: {key} {i!r} is not a token id (0 to {vocab_size - 1})")
        return ids

    tokens_map = _read_json(path / "special_tokens_map.json")  # (older directories name them only there)
    bos_id = token_id(config.get("bos_token", tokens_map.get("bos_token")))
    if bos_id is None:
        bos_id = next(iter(declared_ids(model_config, "config.json", "bos_token_id")), None)
    eos_id = token_id(config.get("eos_token", tokens_map.get("eos_token")))
    declared = [eos_id] + declared_ids(generation, "generation_config.json", "eos_token_id") + \
        declared_ids(model_config, "config.json", "eos_token_id")
    if eos_id is None:
        eos_id = next((i for i in declared if i is not None), None)
    special = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}

    add_bos = config.get("add_bos_token")
    if add_bos is None and (path / "tokenizer.json").is_file():
        # No explicit flag (Llama 3 has none): do what HF's encode() does, i.e. what the post-processor adds.
        add_bos = bos_id is not None and tok.encode("a", add_special_tokens=True).ids[:1] == [bos_id]
    elif add_bos is None:
        add_bos = bos_id is not None  # a bare tokenizer.model: LlamaTokenizer's default
    return Tokenizer(
        tok,
        kind=kind,
        bos_id=bos_id,
        eos_id=eos_id,
        eos_ids=_end_ids(declared, special),
        add_bos=bool(add_bos),
        chat_template=_hf_chat_template(path, config),
    )


def _add_declared_tokens(tok: tokenizers.Tokenizer, path: Path, config: dict) -> None:
    """A bare tokenizer.model's added tokens, as transformers reads them: tokenizer_config.json's
    `added_tokens_decoder` (id -> {content, special, lstrip, rstrip, ...}), else added_tokens.json (content -> id).
    Each takes its id: a piece of the model already, or the next id after the vocabulary."""
    declared = config.get("added_tokens_decoder")
    if declared is None:
        declared = {str(i): {"content": text} for text, i in _read_json(path / "added_tokens.json").items()
                    if type(i) is int}
    if not isinstance(declared, dict):
        raise ModelFormatError(f"{path / 'tokenizer_config.json'}: added_tokens_decoder is not an object")
    entries = []
    for key, value in declared.items():
        text = value.get("content") if isinstance(value, dict) else None
        if not (isinstance(key, str) and key.isdigit() and isinstance(text, str) and text):
            raise ModelFormatError(f"{path}: added token {key!r}: {str(value)[:60]} is not an id and a content")
        entries.append((int(key), text, value))
    for i, text, value in sorted(entries, key=lambda e: e[0]):
        size, held = tok.get_vocab_size(with_added_tokens=True), tok.token_to_id(text)
        if held != i and (held is not None or i != size):
            where = f"the vocabulary has {size} tokens" if held is None else f"the vocabulary holds it as id {held}"
            raise ModelFormatError(f"{path}: added token {text!r} takes id {i}, but {where}")
        flags = {k: bool(value.get(k)) for k in ("lstrip", "rstrip", "single_word")}
        token = AddedToken(text, special=value.get("special", True) is not False, normalized=False, **flags)
        (tok.add_special_tokens if token.special else tok.add_tokens)([token])


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        doc = parse_json(path.read_text(encoding="utf-8"))
    except ValueError as exc:  # (a UnicodeDecodeError among them)
        raise ModelFormatError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        held = "null" if doc is None else type(doc).__name__
        raise ModelFormatError(f"{path} is not a JSON object (it holds {held})")
    return doc


def _as_list(value: Any) -> list:
    return [] if value is None else list(value) if isinstance(value, list) else [value]


def _kind_of(tok: tokenizers.Tokenizer) -> str:
    cfg = json.loads(tok.to_str())
    model = cfg.get("model", {})
    parts = json.dumps([cfg.get("normalizer"), cfg.get("pre_tokenizer"), cfg.get("decoder")], ensure_ascii=False)
    if model.get("type") == "Unigram" or model.get("byte_fallback") or "\u2581" in parts:
        return "spm"
    return "bpe" if "ByteLevel" in parts else "raw"


def _hf_chat_template(path: Path, config: dict) -> str | None:
    if (path / "chat_template.jinja").is_file():  # newer transformers saves it beside the config
        try:
            return (path / "chat_template.jinja").read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ModelFormatError(f"{path / 'chat_template.jinja'} is not UTF-8 text: {exc.reason} at byte "
                                   f"{exc.start}") from None
    template = config.get("chat_template")
    if isinstance(template, list) and all(isinstance(t, dict) for t in template):
        # named: [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if template is not None and not isinstance(template, str):
        raise ModelFormatError(f"{path / 'tokenizer_config.json'}: chat_template must be a string or a list of "
                               "{name, template} objects")
    return template


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        value, shift, pos = value | (byte & 0x7F) << shift, shift + 7, pos + 1
        if not byte & 0x80:
            return value, pos


def _fields(data: bytes):
    """A protobuf message's fields in order: (field number, value: an int, or the bytes of a length-delimited one)."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire in (1, 5):  # fixed 64 or 32 bits
            value, pos = data[pos : pos + (8 if wire == 1 else 4)], pos + (8 if wire == 1 else 4)
        elif wire == 2:
            length, pos = _varint(data, pos)
            value, pos = data[pos : pos + length], pos + length
        else:
            raise ValueError(f"protobuf wire type {wire}")
        yield field, value


def _user_defined_pieces(model: bytes) -> set[int]:
    """The ids of a SentencePiece model file's USER_DEFINED pieces (ModelProto.pieces = 1, each a SentencePiece
    message whose type = 3). The file loaded in sentencepiece already: malformed bytes here mean none."""
    try:
        pieces = [value for field, value in _fields(model) if field == 1]
        return {i for i, piece in enumerate(pieces) if dict(_fields(piece)).get(3) == USER_DEFINED}
    except (ValueError, IndexError):
        return set()


def _from_sentencepiece_file(file: Path, legacy: bool = True) -> tokenizers.Tokenizer:
    """`legacy` (LlamaTokenizer's flag, true unless tokenizer_config.json says false): the text after a control
    token begins with a "▁" as the text's start does; without it, only the start does (as transformers reads it)."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(file))
    n = sp.get_piece_size()
    # (sentencepiece's Python API cannot tell a user-defined piece from a normal one; the file can)
    user_defined = _user_defined_pieces(file.read_bytes())
    types = [
        UNKNOWN if sp.is_unknown(i) else CONTROL if sp.is_control(i) else BYTE if sp.is_byte(i)
        else UNUSED if sp.is_unused(i) else USER_DEFINED if i in user_defined else NORMAL
        for i in range(n)
    ]
    pieces = [sp.id_to_piece(i) for i in range(n)]
    scores = [sp.get_score(i) for i in range(n)]
    # SentencePiece's BPE trainer scores each piece by its merge rank (0, -1, -2, ...); Unigram models
    # hold log-probabilities, which merges cannot reproduce.
    if any(s != int(s) for s, ty in zip(scores, types) if ty == NORMAL):
        raise UnsupportedModelError(
            f"{file} is a SentencePiece Unigram model, which llmrun cannot read; provide a tokenizer.json"
        )
    # The prefix flag lives in the model proto, which needs protobuf to parse; the output shows it too.
    add_space_prefix = sp.encode("a", out_type=str)[0].startswith("\u2581")
    tok = _sentencepiece_bpe(
        pieces, scores, types, unk_id=sp.unk_id() if sp.unk_id() >= 0 else None,
        add_space_prefix=add_space_prefix,
    )
    _add_special_tokens(tok, pieces, types)
    if add_space_prefix and not legacy:
        tok.normalizer = None  # (the Metaspace writes spaces as "▁" too)
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    # A model trained with a normalizer (NFKC, collapsing spaces) would tokenize differently: check.
    probe = "Hello world, 12 naïve 🙂\n  x"
    if tok.encode(probe, add_special_tokens=False).ids != sp.encode(probe):
        raise UnsupportedModelError(
            f"{file} normalizes text in a way llmrun does not reproduce; provide a tokenizer.json"
        )
    return tok
