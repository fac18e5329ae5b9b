"""The data layer's error for a bad setting: it names the argument, so a caller that fed the argument
from its own config (the trainer) can report the config key instead."""


class SettingError(ValueError):
    """An invalid argument of a dataset or loader; `field` is the argument's name."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
