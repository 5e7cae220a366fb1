"""The vertical learning core: data, partitions, problems, VFB² update rules and their kernels, the
centralised reference solver, label-DP accounting and the metric log. No MPI, no wire format: every
formula here is testable in one process (``parties`` runs it across processes, ``protocols`` moves
its numbers)."""
