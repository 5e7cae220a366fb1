"""Learning algorithms of the vertical side (update rules; no MPI here)."""
