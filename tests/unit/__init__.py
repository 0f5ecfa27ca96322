"""Serial tests that run in this process: no mpirun, no launched program."""
