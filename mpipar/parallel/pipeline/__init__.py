"""Pipeline parallelism: schedules as data (:mod:`.schedule`: op lists per rank, a dry run that
proves them deadlock-free, bubble formulas) and the executor that walks them with MPI
point-to-point (:mod:`.executor`); ``rule.py``: layers over the stages and a buildable
schedule; ``cost.py``: the pp calls and the pipeline's memory and time terms; ``axis.py``: the
pipeline axis (:class:`mpipar.parallel.axis.Axis`)."""
