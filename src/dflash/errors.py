"""Exceptions with messages that name the problem."""


class DFlashError(ValueError):
    """Base class for every input error raised by dflash."""


class DFlashConfigError(DFlashError):
    """A draft config that is malformed or does not fit its target."""


class DFlashInputError(DFlashError):
    """Bad arguments to a generation call (empty prompt, shape mismatch, bad sampling parameters)."""
