"""Errors a user can act on: one line naming the file, key or line at fault."""


def first_line(e: BaseException) -> str:
    """An exception as one short line, for a message of ours (libraries' run to many lines)."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300]}" if text else type(e).__name__


class MegatrainError(Exception):
    """Base class; the CLI prints these as a one-line message without a traceback."""


class ConfigError(MegatrainError):
    """A bad configuration key or value, or a bad model config.json."""


class DataError(MegatrainError):
    """A dataset file that cannot be read or a record that is malformed."""


class CheckpointError(MegatrainError):
    """A checkpoint or weight file that is missing or inconsistent."""


class OutputError(MegatrainError):
    """An output megatrain cannot or will not write: the disk is full, or the path holds files
    that megatrain did not write (they are never replaced)."""
