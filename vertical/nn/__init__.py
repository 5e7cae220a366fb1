"""Party models for vertical learning: each party's part of the model, of which a linear block is k = 1.

A party's contribution to a row is ``h_l(x_l) ∈ R^k``; the secure sum gives the active party
``z = Σ_l h_l(x_l)``; its top model and loss turn z into ``ϑ = ∂ℓ/∂z ∈ R^k`` per row; every party steps
its own part from (ϑ, i). With k = 1, ``h_l(x_l) = w_l·x_l`` and an identity top, this is VFB² exactly.

Modules (torch is imported only by the ones marked so; the linear path never imports it):

* :mod:`~vertical.nn.base` - the :class:`PartyModel` and :class:`TopModel` interfaces, spec strings;
* :mod:`~vertical.nn.linear` - today's linear block and loss as a k = 1 party model and identity top;
* :mod:`~vertical.nn.networks` (torch) - an MLP bottom per party, a top network with its loss;
* :mod:`~vertical.nn.central` (torch) - the centralised reference: the assembled network on all columns;
* :mod:`~vertical.nn.protection` - clipping and Gaussian noise on each row's ϑ, calibrated by the RDP
  accountant of :mod:`vertical.label_privacy`;
* :mod:`~vertical.nn.messages` - the k-wide (ϑ, i) message (the k = 1 layout is today's);
* :mod:`~vertical.nn.simulate` - VFB² for party models in one process, with bounded staleness, and the
  lock-step split-learning baseline.

``docs/vertical-networks.md`` is the design, and what the MPI runtime has to carry for it.
"""
