"""One exception family for everything a user can cause: the CLI prints `error: <message>` and exits 1 (2 for a
`UsageError`)."""


class LlmrunError(Exception):
    """A problem the user can fix; the message says what happened and what to do."""


class UsageError(LlmrunError):
    """Options that cannot go together, or a value an option cannot take: exit code 2, as for the parser's own."""


class ModelNotFoundError(LlmrunError):
    pass


class ModelFormatError(LlmrunError):
    """A model file is corrupt, truncated or of an unsupported kind."""


class UnsupportedModelError(LlmrunError):
    pass


class ContextOverflowError(LlmrunError):
    pass


class OutsideVocabularyError(LlmrunError):
    """A token id past the model's embedding: its tokenizer has more tokens than its weights have rows."""


def read_stdin() -> str:
    """The text on stdin, less the byte-order mark some editors write (it is not text)."""
    import sys

    return sys.stdin.read().removeprefix("\ufeff")


def check_utf8(text: str) -> None:
    """Text from argv or a pipe that was not UTF-8 reaches us with its bad bytes as lone surrogates (Python's
    surrogateescape); say so rather than let the tokenizer fail on them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        what = f"byte 0x{code - 0xdc00:02x}" if 0xdc80 <= code <= 0xdcff else f"lone surrogate U+{code:04X}"
        raise LlmrunError(f"the text is not UTF-8 ({what} at character {e.start})") from None


def not_finite(dtype) -> LlmrunError:
    """The error for a model whose output holds NaN or inf, computed in torch dtype `dtype`."""
    hint = "" if str(dtype) == "torch.float32" else f", or {dtype} overflowed: try --dtype fp32"
    return LlmrunError(f"the model's output is not finite (NaN or inf): its weights are corrupt{hint}")


def parse_json(text: str | bytes):
    """`json.loads`, where a document nested deeper than Python's parser recurses (`[[[[...`, a corrupt or hostile
    file) is a ValueError as any other malformed JSON, not a RecursionError."""
    import json

    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply to parse") from None
