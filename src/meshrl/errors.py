"""Error types shared by the library's components (kept here so that components owning their config can raise
them without importing `meshrl.config`)."""


class ConfigError(ValueError):
    """A user-fixable problem with the run configuration."""


class DataError(ValueError):
    """A user-fixable problem with the data: a source that does not exist or holds no usable row, a bad row."""
