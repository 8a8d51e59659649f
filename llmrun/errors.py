"""One exception family for everything a user can cause: the CLI prints `error: <message>` and exits 1."""


class LlmrunError(Exception):
    """A problem the user can fix; the message says what happened and what to do."""


class ModelNotFoundError(LlmrunError):
    pass


class ModelFormatError(LlmrunError):
    """A model file is corrupt, truncated or of an unsupported kind."""


class UnsupportedModelError(LlmrunError):
    pass


class ContextOverflowError(LlmrunError):
    pass
