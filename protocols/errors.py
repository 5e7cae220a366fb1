"""The exceptions of the protocols: one type for "another party sent something the protocol forbids".

Every value that arrives from another party (a header word, an index, a count, a length, a float) is
checked where it is received, before it can index an array, size an allocation or reach a compiled
kernel. A message that fails a check raises :class:`ProtocolViolation`, which names the sender, so the
job that ends because of it says which party misbehaved (the runtime prints it and aborts every rank).
"""

from __future__ import annotations

__all__ = ["ProtocolError", "ProtocolViolation"]


class ProtocolError(RuntimeError):
    """A protocol state that correct parties cannot reach (a message, or a local call out of order)."""


class ProtocolViolation(ProtocolError):
    """Party ``sender`` sent an invalid ``what`` (e.g. "(ϑ, i) message"): ``detail`` says which check failed.

    The message always reads ``party <sender> sent an invalid <what>: <detail>`` so that logs and the
    runtime's abort line lead with the offending party.
    """

    def __init__(self, sender: int, what: str, detail: str) -> None:
        self.sender = sender
        self.what = what
        self.detail = detail
        super().__init__(f"party {sender} sent an invalid {what}: {detail}")

    def __reduce__(self):  # keep the three fields when the exception crosses a thread or process pool
        return type(self), (self.sender, self.what, self.detail)
