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


MAX_TEXT = 256 << 20  # bytes (characters on stdin) of a text input: a prompt, a schema, eval's or AWQ's text


def read_stdin() -> str:
    """The text on stdin, less the byte-order mark some editors write (it is not text). At most MAX_TEXT
    characters: `< /dev/zero` would fill the memory."""
    import sys

    text = sys.stdin.read(MAX_TEXT + 1)
    if len(text) > MAX_TEXT:
        raise LlmrunError(f"stdin holds more than {MAX_TEXT >> 20} MiB of text; give less")
    return text.removeprefix("\ufeff")


def read_text_bytes(path, name: str) -> bytes:
    """The bytes of the text file `path` (`name`: how messages call it), at most MAX_TEXT of them: /dev/zero or
    a runaway file would fill the memory. OSError passes to the caller, which knows what the file was for."""
    with open(path, "rb") as f:
        data = f.read(MAX_TEXT + 1)
    if len(data) > MAX_TEXT:
        raise LlmrunError(f"{name} is larger than {MAX_TEXT >> 20} MiB; give a smaller text file")
    return data


def read_text_file(path, name: str, hint: str = "") -> str:
    """The UTF-8 text of the file `path` (a byte-order mark, as some editors write, dropped), at most MAX_TEXT
    bytes; whatever goes wrong is one LlmrunError naming the file as `name`, `hint` ("; give ...") after it."""
    try:
        data = read_text_bytes(path, name)
    except FileNotFoundError:
        raise LlmrunError(f"{name}: no such file{hint}") from None
    except IsADirectoryError:
        raise LlmrunError(f"{name} is a directory{hint or '; give a text file'}") from None
    except OSError as e:
        raise LlmrunError(f"cannot read {name} ({e.strerror or e}){hint}") from None
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise LlmrunError(f"{name} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}){hint}") from None


def check_utf8(text: str, what: str = "the text") -> None:
    """Text from argv or a pipe that was not UTF-8 reaches us with its bad bytes as lone surrogates (Python's
    surrogateescape); say so (naming it as `what`) rather than let the tokenizer or a compiler fail on them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        bad = f"byte 0x{code - 0xdc00:02x}" if 0xdc80 <= code <= 0xdcff else f"lone surrogate U+{code:04X}"
        raise LlmrunError(f"{what} is not UTF-8 ({bad} at character {e.start})") from None


def not_finite(dtype=None) -> LlmrunError:
    """The error for a model whose output holds NaN or inf, computed in torch dtype `dtype` (None: not known here,
    as where a token is drawn)."""
    overflowed = "a 16-bit --dtype" if dtype is None else dtype
    hint = "" if str(dtype) == "torch.float32" else f", or {overflowed} overflowed: try --dtype fp32"
    return LlmrunError(f"the model's output is not finite (NaN or inf): its weights are corrupt{hint}")


def parse_json(text: str | bytes):
    """`json.loads`, where a document nested deeper than Python's parser recurses (`[[[[...`, a corrupt or hostile
    file) is a ValueError as any other malformed JSON, not a RecursionError."""
    import json
    import sys

    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply to parse") from None
    except ValueError as e:
        if "int_max_str_digits" in str(e):  # Python's advice to call sys.set_int_max_str_digits() is not the user's
            raise ValueError(f"a number has more than {sys.get_int_max_str_digits()} digits") from None
        raise
