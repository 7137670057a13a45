"""The errors the trainer's modules share, in a leaf that imports nothing of ours (so that the lowest
module may raise them): a config that breaks a rule (`ConfigError`: sage-train and sage-eval print it
as one line and exit 2), a path in a run directory sage refuses (`RunDirError`, `NotAFileError`: such
a config error), and a run that cannot go on (`RunError`: one line, exit 1)."""


class ConfigError(ValueError):
    """A config key is unknown or its value has the wrong type or range."""


class RunDirError(ConfigError):
    """A path in a run (or output) directory that sage refuses to open: a link, a folder where a
    file belongs, a FIFO, a name too long for the filesystem."""


class NotAFileError(RunDirError):
    """A file sage would read that is not a regular one (a FIFO, a device, a folder, a dangling link),
    or larger than any file of its kind may be."""


class RunError(RuntimeError):
    """The run cannot go on (a full disk, steps that stay non-finite); the message says why and what is
    kept. `sage-train` prints it as one line and exits 1."""
