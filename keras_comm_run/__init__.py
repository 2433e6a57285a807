"""keras-comm-run: start a MultiWorkerMirroredStrategy job's worker processes.

`keras-comm-run -n N script.py [args...]` starts N copies of a Python script
(or module), each with the `TF_CONFIG` that
`tf.distribute.MultiWorkerMirroredStrategy` reads, forwards the chief's output
live (every rank's with `--console-ranks all`, each line prefixed by the
worker's rank), and tears the whole job down as
soon as one worker fails, the launcher is interrupted, or a timeout expires;
optionally it restarts the job, spans several nodes, pins GPUs and writes
per-rank logs (`keras-comm-run --help`).

This package is separate from `keras_comm` and uses only the standard
library, so starting the launcher never imports TensorFlow (importing any
`keras_comm` module would: the package applies its Keras fix on import).
`keras_comm.launch` re-exports it. Modules:

- `cluster`: addresses, ports, TF_CONFIG and each worker's environment
  (pure; `keras_comm.topology` uses its `validate_tf_config`);
- `rendezvous`: how the nodes of a several-node job agree on the cluster;
- `schedulers`: what Slurm and Kubernetes tell the launcher (node rank,
  node count, node 0's address);
- `output`: live, prefixed, filtered and logged forwarding of worker output;
- `supervisor`: `run`, which starts, watches, stops and restarts workers;
- `bootstrap`: how a worker runs the script so that SIGTERM stops it cleanly;
- `cli`: the command line;
- `check`: the workers of `keras-comm-run --check` (they import
  TensorFlow; the launcher never imports this module).

Example:

```
keras-comm-run -n 2 train.py --epochs 1
python -m keras_comm_run -n 2 -m examples.mnist --epochs 1
```

From Python (tests, benchmarks):

```python
import keras_comm_run
exit_code = keras_comm_run.run(["train.py", "--epochs", "1"], num_workers=2, timeout=600)
```
"""

from keras_comm_run.cli import main
from keras_comm_run.cluster import LaunchError
from keras_comm_run.cluster import pick_ports
from keras_comm_run.cluster import tf_config
from keras_comm_run.cluster import validate_tf_config
from keras_comm_run.cluster import worker_env
from keras_comm_run.supervisor import EXIT_TIMEOUT
from keras_comm_run.supervisor import EXIT_USAGE
from keras_comm_run.supervisor import PROG
from keras_comm_run.supervisor import run

__all__ = [
    "EXIT_TIMEOUT",
    "EXIT_USAGE",
    "LaunchError",
    "PROG",
    "main",
    "pick_ports",
    "run",
    "tf_config",
    "validate_tf_config",
    "worker_env",
]
