"""The message kinds of a party's two planes, and the envelope check of the data plane.

Data plane (``parties/data_plane.py``): tagged point-to-point messages through one
:class:`~protocols.transport.MpiTransport`, each kind named in :data:`MESSAGE_KINDS`. Control plane
(``parties/control_plane.py``): the barrier-time exchanges, each a named method of
:class:`~parties.control_plane.ControlPlane` and a kind in :data:`CONTROL_KINDS`. What a party receives
on the control plane is audited under the ``AUDIT_*`` labels, which the saved transcripts carry
(``parties/audit.py``; ``experiments/label_attacks.py`` reads them).
"""

from __future__ import annotations

from protocols.errors import ProtocolViolation
from protocols.transport import AGGREGATION_TAG

TAG_THETA = 0x7E7A
#: --piggyback: step t's (ϑ, i) message and step t + 1's aggregation request in one buffer
#: (protocols/dispatch.py, ``piggyback``)
TAG_THETA_REQUEST = 0x7E7B
#: sync modes: a collaborator's acknowledgement of one (ϑ, i), carrying its sequence number
TAG_ACK = 0xAC4
#: "this party sends nothing more on the data plane": the last message of every party to every party
#: (itself included) when the runtime closes; MPI keeps one sender's messages in order, so after one
#: from every party nothing is left in flight and the communicator can be freed
TAG_STOP = 0x5709
#: a dominator's end of segment: ``[segment, count]`` (int64), its segment number (1, 2, ...) and the
#: (ϑ, i) it has broadcast in all
TAG_DONE = 0xD0E
TAG_HEARTBEAT = 0xBEA7
TAG_FULL_THETA = 0xF7E7  # on the control communicator, point to point
#: The control plane's point-to-point exchanges (parties/control_plane.py): a barrier's token (its
#: number), a control word from a root, one word from every party (sums, the DP setup, row norms), a
#: sync-global agreement, a public key (its byte count first).
TAG_BARRIER = 0xBA4
TAG_WORD = 0xC0D
TAG_GATHER = 0x6A7
TAG_AGREE = 0xA64
TAG_KEY = 0x4E4
#: before the runtime, on the job's own communicator: the digest of a party's sample ids
TAG_IDS = 0x1D5
#: --label-privacy he (protocols/label_he.py): encrypted batch to a passive party, its masked encrypted
#: gradient back to the dominator, and the dominator's decryption of it (still masked) to the party.
TAG_HE_BATCH = 0x4E7A
TAG_HE_MASKED = 0x4E3A
TAG_HE_DECRYPTED = 0x4E9A
#: --label-privacy he, SVRG snapshots (control communicator, point to point): the encrypted full ϑ_0 to
#: a passive party (its byte count first), its masked encrypted X_lᵀϑ_0 back, the masked decryption.
TAG_HE_FULL = 0xF4E7
TAG_HE_FULL_MASKED = 0xF4E3
TAG_HE_FULL_DECRYPTED = 0xF4E9
#: Audit labels of what arrives on the control communicator (collectives, not tagged messages there):
#: secure-aggregation traffic of the full passes, the full ϑ vector, and control words.
AUDIT_CTRL_AGGREGATION = 0x1C5EC
AUDIT_FULL_THETA = 0x1C7E7
AUDIT_CONTROL_WORD = 0x1C0DE
#: --label-privacy he: a dominator's public key (control plane), and what a passive party learns from
#: each batch once it removed its own mask: its block gradient Σ_i ϑ_i x_i (recorded so that attacks
#: on the transcript see everything the party knows; nothing crosses under this label).
AUDIT_HE_KEY = 0x1C4E0
AUDIT_HE_GRADIENT = 0x1C4E6
#: ... and from each SVRG snapshot's encrypted full pass: X_lᵀϑ_0 (n μ_l), the only thing it learns there.
AUDIT_HE_FULL_GRADIENT = 0x1C4E7
AUDIT_LABELS = (AUDIT_CTRL_AGGREGATION, AUDIT_FULL_THETA, AUDIT_CONTROL_WORD, AUDIT_HE_KEY, AUDIT_HE_GRADIENT,
                AUDIT_HE_FULL_GRADIENT)
#: What each data-plane tag carries, as error messages name it ("party 2 sent an invalid <kind>: ...").
MESSAGE_KINDS = {
    AGGREGATION_TAG: "aggregation message", TAG_THETA: "(ϑ, i) message",
    TAG_THETA_REQUEST: "piggybacked (ϑ, i) message", TAG_DONE: "DONE message", TAG_ACK: "ACK message",
    TAG_STOP: "STOP message", TAG_HEARTBEAT: "heartbeat", TAG_HE_BATCH: "encrypted batch",
    TAG_HE_DECRYPTED: "decrypted gradient", TAG_HE_MASKED: "masked gradient",
}
#: Every exchange of the control plane (one :class:`~parties.control_plane.ControlPlane` method each),
#: by the name its errors use; point-to-point ones by their tag, collectives by their method.
CONTROL_KINDS = {
    "barrier": "barrier",
    "broadcast_word": "control word",
    "broadcast_float": "control word",
    "sum_word": "control sum",
    "broadcast_public_key": "public key",
    "gather_row_norms": "row-norm bounds",
    "agree": "lockstep agreement",
    TAG_BARRIER: "barrier token",
    TAG_WORD: "control word",
    TAG_GATHER: "control word",
    TAG_AGREE: "lockstep agreement",
    TAG_KEY: "public key",
    TAG_FULL_THETA: "full ϑ",
    TAG_HE_FULL: "encrypted full pass",
    TAG_HE_FULL_MASKED: "masked full gradient",
    TAG_HE_FULL_DECRYPTED: "decrypted full gradient",
}
#: Largest message on the data communicator (the hot path sends B = 1 messages of a few words; the
#: batched full passes use the collective library call on a separate communicator).
MAX_MESSAGE_WORDS = 1 << 13
#: At most this many queued (ϑ, i) messages are applied by one kernel call.
WORKER_BATCH = 256


def check_envelope(source: int, tag: int, nbytes: int, *, rank: int, active_ranks: list[int],
                   synchronous: bool, he: bool = False) -> None:
    """Check what MPI says about one data-plane message (sender, tag, size) before its words are read.

    Contents are checked by their own receivers (``Inbox``, ``AggregationNode.receive``); this catches
    what they cannot: an unknown tag, a sender that may not send that kind (only dominators send ϑ and
    DONE), and sizes that are not the kind's exact word count (two for DONE, one for ACK, STOP and
    heartbeats).
    """
    what = MESSAGE_KINDS.get(tag)
    if what is None:
        raise ProtocolViolation(source, "message", f"unknown tag {tag:#x}")
    if tag == AGGREGATION_TAG:
        allowed, words = source != rank, None
    elif tag == TAG_THETA:
        allowed, words = source != rank and source in active_ranks, None
    elif tag == TAG_THETA_REQUEST:
        allowed, words = source != rank and source in active_ranks and not synchronous and not he, None
    elif tag == TAG_DONE:
        allowed, words = source != rank and source in active_ranks, 2
    elif tag == TAG_ACK:
        allowed, words = source != rank and synchronous, 1
    elif tag in (TAG_STOP, TAG_HEARTBEAT):  # a second STOP from one party: DataPlane._on_stop
        allowed, words = True if tag == TAG_STOP else source != rank, 1
    elif tag in (TAG_HE_BATCH, TAG_HE_DECRYPTED):  # dominator → passive party
        allowed, words = he and source in active_ranks and rank not in active_ranks, None
    else:  # TAG_HE_MASKED: passive party → dominator
        allowed, words = he and source not in active_ranks and rank in active_ranks, None
    if not allowed:
        raise ProtocolViolation(source, what, f"party {source} may not send it to party {rank}")
    if nbytes <= 0 or nbytes % 8:
        raise ProtocolViolation(source, what, f"{nbytes} bytes is not a whole, non-zero number of words")
    if words is not None and nbytes != 8 * words:
        raise ProtocolViolation(source, what, f"{nbytes // 8} words, expected {words}")
