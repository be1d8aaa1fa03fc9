"""The one exception type for user mistakes: its message names the bad value and the fix."""


class DistillSpecError(ValueError):
    """A user-facing error (bad config, bad model pair, bad data). Entry points print it on one line."""
