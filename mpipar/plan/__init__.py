"""The planner: what a layout costs one rank, and which layout of a world to run.

- :mod:`.rank`: what one rank of a layout holds and runs (shards, buckets, units, its schedule)
  and the nodes and group sizes the planner assumes;
- :mod:`.traffic`: the MPI calls of a step, each parallel axis's own prediction concatenated
  (bytes, messages and wire bytes per group: what the ledger is held to);
- :mod:`.memory`: a rank's state, activations and peak;
- :mod:`.step_time`: the hardware and the step time (the model FLOPs: :mod:`mpipar.model.flops`);
- :mod:`.search`: the layouts of a world, ranked; the default run's choice;
- :mod:`.cli`: ``python -m mpipar.plan``.

Nothing here needs MPI: the planner runs where mpi4py cannot be imported.
"""
