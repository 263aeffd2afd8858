"""One exception root for fedge, with a subclass per concern.

Every error raised for bad input carries a message that says what is wrong and what to do about it, so the CLI can
print it instead of a traceback.
"""


class FedgeError(Exception):
    """Root of every error fedge raises on purpose."""


class ConfigError(FedgeError, ValueError):
    """A setting is missing, out of range or inconsistent with another one."""


class DatasetError(FedgeError):
    """A dataset file is missing, truncated or not in the expected format."""


class CodecError(FedgeError, ValueError):
    """A message could not be decoded or failed validation (shape, dtype, non-finite values, metadata)."""


class TransportError(FedgeError):
    """A broker or peer could not be reached, or a connection was lost."""


class ExportError(FedgeError):
    """Exporting a model failed, or an export failed its parity check."""


class JournalError(FedgeError):
    """A run directory cannot be resumed: no journal, a journal of another config, or a finished run."""
