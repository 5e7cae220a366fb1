"""``vfl serve``: a trained federation that stays up and scores customers on request (issue 29).

One process per party under one ``mpiexec`` (:mod:`parties.serving.rank`), each holding only its own
block or network and its own feature rows keyed by id (:mod:`parties.serving.store`). The leader
(rank 0) answers HTTP (:mod:`parties.serving.front`), gathers concurrent requests into one aggregation
(:mod:`parties.serving.batching`), and drives the federation (:mod:`parties.serving.federation`): the
ids go to the passive parties as buffer messages (:mod:`parties.serving.wire`), and the scores come
from the same secure aggregation as training and ``vfl predict``.

Per organisation (``vfl party … --serve``, :mod:`parties.serving.party`): each party joins one
federation after another (:mod:`parties.serving.federated`), and the leader's endpoint outlives them
(:mod:`parties.serving.supervisor`, over a local link, :mod:`parties.serving.link`).
"""
