"""Pipeline parallelism: schedules as data (:mod:`.schedule`: op lists per rank, a dry run that
proves them deadlock-free, bubble formulas) and the executor that walks them with MPI
point-to-point (:mod:`.executor`)."""
