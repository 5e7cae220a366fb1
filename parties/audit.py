"""The audit recorder of one party (``--audit``): everything it received, on every communicator.

Data-plane messages are kept under their tag (``parties/messages.py``), what arrives on the control
plane under an ``AUDIT_*`` label, and the full passes' secure-aggregation traffic (recorded by a
:class:`~protocols.transport.RecordingTransport` around the aggregator's transport) under
``AUDIT_CTRL_AGGREGATION``. The saved npz is what the message-audit tests and
``experiments/label_attacks.py`` read: its format is an interface.
"""

from __future__ import annotations

import numpy as np

from parties.messages import AUDIT_CTRL_AGGREGATION
from protocols.transport import RecordingTransport


class AuditLog:
    """The transcript of one party: ``(source, tag or label, words)`` per message received.

    ``records`` is None when auditing is off, so the data plane's per-message check is one ``is None``.
    """

    def __init__(self, rank: int, enabled: bool) -> None:
        self.rank = rank
        self.records: list[tuple[int, int, np.ndarray]] | None = [] if enabled else None
        #: the aggregator's transport, when it records (:meth:`watch`)
        self._aggregation: RecordingTransport | None = None

    @property
    def enabled(self) -> bool:
        return self.records is not None

    def watch(self, aggregator) -> None:
        """Record the secure aggregator's full-pass traffic too (wraps its transport)."""
        if self.records is not None:
            self._aggregation = RecordingTransport(aggregator.transport)
            aggregator.transport = self._aggregation

    def record(self, source: int, label: int, values: np.ndarray) -> None:
        """Audit what arrived from ``source`` (-1: from everyone) by a collective on the control plane."""
        if self.records is not None and source != self.rank:
            self.records.append((source, label, np.ascontiguousarray(values).view(np.uint64).copy()))

    def save(self, path, *, sent: int, applied: np.ndarray, max_unacked: int) -> None:
        """Write the transcript with the data plane's counters (``sent``, ``applied``, ``max_unacked``)."""
        assert self.records is not None
        records = list(self.records)
        if self._aggregation is not None:
            records += [(source, AUDIT_CTRL_AGGREGATION, words)
                        for source, words in self._aggregation.received]
        np.savez(path, sources=np.array([r[0] for r in records], dtype=np.int64),
                 tags=np.array([r[1] for r in records], dtype=np.int64),
                 lengths=np.array([r[2].size for r in records], dtype=np.int64),
                 words=np.concatenate([r[2] for r in records]) if records else np.zeros(0, np.uint64),
                 sent=sent, applied=applied, max_unacked=max_unacked)
