"""The codes by which the lazy numba kernels (:mod:`vertical.kernels`) tell the update rules apart.

Declared apart from the kernels so that the rules (:mod:`vertical.algorithms.vfb2`), and with them the
algorithm table that ``vfl train``'s options are built from, are defined without importing numba: a
launcher never runs a kernel, and numba costs it a large part of a second of start-up.
"""

#: Which dense term a step has and what its ϑ is compared with (the regularisers' codes are declared with
#: them, in ``vertical.problems``).
MODE_SGD, MODE_SVRG, MODE_SAGA_SCALAR = 0, 1, 2
