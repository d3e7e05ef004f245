"""The one exception type for user mistakes.

Library functions raise `UserError` when their input is wrong (a missing file, a prompt that
does not fit, a checkpoint of another kind). Entry points catch it and print its message as one
line, without a traceback, so the message itself must say what to do instead.
"""


class UserError(ValueError):
    """A mistake the user can fix; the message says how."""
