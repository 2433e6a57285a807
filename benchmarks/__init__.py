"""keras_comm benchmarks: our layers side by side with raw TF, MPI and the machine.

Run everything with one command (it starts its own worker processes):

    python -m benchmarks.run --workers 2 --out results/

Modules, one per benchmark family:

* `benchmarks.collectives` -- collective bandwidth of each keras_comm layer
  (forward and forward+backward) against the raw TF collective doing the same
  communication, timed interleaved in the same processes; layer overhead
  ratios; ReduceScatter (all-to-all + local sum) against all-reduce + slice.
* `benchmarks.fusion` -- fusion groups: the backward all-reduces of M
  mirrored parameters unfused, fused by keras_comm, and packed by raw TF.
* `benchmarks.mpi` -- the same collectives through mpi4py (MPICH), the
  reference for what this machine's processes can exchange.
* `benchmarks.training` -- `model.fit` throughput and scaling; the
  `ParallelOptimizer` callback's accumulation and ZeRO stages.
* `benchmarks.report` -- the JSON, Markdown table and PNG plots.
* `benchmarks.worker` -- the script each TensorFlow worker process runs.

Nothing here asserts speed: figures depend on the machine and its load.
"""
