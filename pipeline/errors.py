"""Errors that the command line turns into exit codes.

Every failure a user can cause by handing us bad input is an `InputError`
(exit 2); a leak between calibration and evaluation data found by the audit is
an `AuditViolation` (exit 3). Both carry one line that names what and where, so
the CLI can print it as is.
"""


class MoehealError(Exception):
    """Base of the errors the CLI reports as one line.

    The message is kept to one line here, whatever it quotes (a value from a
    damaged file, a library's multi-line message), because the contract is
    one line on stderr and a message is built in many places.
    """

    exit_code = 1

    def __init__(self, message: str = ""):
        super().__init__(" ".join(str(message).splitlines()))


class InputError(MoehealError):
    """Bad input: a missing or corrupt file, a bad config value, NaN in activations."""

    exit_code = 2


class AuditViolation(MoehealError):
    """Calibration and evaluation data are not disjoint (doc reuse, n-gram leak)."""

    exit_code = 3
