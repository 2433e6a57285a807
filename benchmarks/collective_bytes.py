"""Bytes handed to collectives per training step, counted in the traced step.

`benchmarks.memory.bytes_per_step` computes what a configuration should move
from ring formulas. This module counts instead: it finds the tf.functions
that `fit` ran for one step (the model's train function, or
ParallelOptimizer's apply step), walks their graphs and sums, for the ops
placed on replica 0's device, the input size of every collective op:

| op | handed in (one replica) | sent by a ring (one replica) |
| --- | --- | --- |
| CollectiveReduceV2 (all-reduce) | X | 2 (N-1)/N X |
| CollectiveGatherV2 (all-gather) | X = S/N | (N-1) X |
| CollectiveAllToAllV2 (keras_comm's reduce-scatter: all-to-all, then a local sum) | X = S | (N-1)/N X |
| CollectiveReduceScatterV2 | X = S | (N-1)/N X |

so a measured "sent" figure comes from the graph's real tensors (padding,
fusion into packs, extra scalars for the loss and metrics included) and
can be set beside the formula. In-process replicas (logical CPU devices)
trace the same step as worker processes; only the device strings differ.

Run: ``python -m benchmarks.collective_bytes [--replicas 2 4] [--models tiny mlp42m]``
(in-process: one process with 4 logical CPU devices) prints a markdown table.
"""

import argparse
import collections
import sys

import keras
import tensorflow as tf

from benchmarks import _graphs

_COLLECTIVES = {
    "CollectiveReduceV2": "all_reduce",
    "CollectiveGatherV2": "all_gather",
    "CollectiveAllToAllV2": "reduce_scatter",  # keras_comm's scatter_batch_sum
    "CollectiveReduceScatterV2": "reduce_scatter",
}


def ring_sent(kind, handed, n):
    """Bytes one replica sends in a ring algorithm for `handed` input bytes."""
    if kind == "all_reduce":
        return 2 * (n - 1) / n * handed
    if kind == "all_gather":
        return (n - 1) * handed
    return (n - 1) / n * handed


def count(functions, n, device_suffix="CPU:0"):
    """``{kind: {"ops", "handed", "sent", "sizes"}}`` over every concrete
    function of `functions`, for the collectives placed on the device whose
    name ends with `device_suffix` (replica 0 in process)."""
    out = collections.defaultdict(lambda: {"ops": 0, "handed": 0, "sent": 0.0, "sizes": []})
    for fn in functions:
        # Every trace of the step (fit traces it once per input signature).
        for concrete in fn._list_all_concrete_functions():
            for op in concrete.graph.get_operations():
                kind = _COLLECTIVES.get(op.type)
                if kind is None or not op.device.endswith(device_suffix):
                    continue
                x = op.inputs[0]
                nbytes = int(x.shape.num_elements()) * x.dtype.size
                row = out[kind]
                row["ops"] += 1
                row["handed"] += nbytes
                row["sent"] += ring_sent(kind, nbytes, n)
                row["sizes"].append(nbytes)
    return dict(out)


class CaptureStep(keras.callbacks.Callback):
    """Keeps the step functions `fit` ran. ParallelOptimizer puts its own
    train function in place for the fit and restores the model's at its
    end, so this callback reads it after every batch."""

    def __init__(self):
        super().__init__()
        self.functions = []

    def on_train_batch_end(self, batch, logs=None):
        self.functions = list(_graphs.tf_functions(self.model.train_function))


_STRATEGIES = {}


def _strategy(n):
    """One in-process strategy per replica count: a second one over the same
    devices would reuse its collective keys (as tests/conftest.py)."""
    if n not in _STRATEGIES:
        _STRATEGIES[n] = _new_strategy(n)
    return _STRATEGIES[n]


def _new_strategy(n):
    cls = tf.distribute.MultiWorkerMirroredStrategy
    cls._collective_key_base = 90000 + 1000 * n
    try:
        return cls._from_local_devices([f"/cpu:{i}" for i in range(n)])
    finally:
        cls._collective_key_base = 0


def measure(config, model_name, n, strategy):
    """Traces one fit step of `config` (a benchmarks.memory CONFIGS key) on
    `n` in-process replicas; returns the per-kind counts and the formula."""
    import numpy as np

    from benchmarks import memory

    spec = memory.MODELS[model_name]
    model, callbacks = memory.CONFIGS[config](strategy, model_name)
    capture = CaptureStep()
    features, _, outputs = spec
    x = np.zeros((2 * n, features), "float32")
    y = np.zeros((2 * n, outputs), "float32")
    model.fit(x, y, batch_size=2 * n, epochs=1, verbose=0, callbacks=[capture] + callbacks)
    counts = count(capture.functions, n)
    return counts, memory.bytes_per_step(config, spec, n)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--models", nargs="+", default=["tiny", "mlp42m"])
    parser.add_argument("--configs", nargs="+", default=["plain", "zero2", "zero3"])
    args = parser.parse_args(argv)
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * max(args.replicas)
    )
    import keras_comm  # noqa: F401

    kib = 2**10
    print("| model | N | configuration | collectives (ops on replica 0) | handed in KiB | "
          "sent KiB (ring, measured tensors) | of which scalars KiB | formula sent KiB | "
          "measured / formula |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model_name in args.models:
        for n in args.replicas:
            strategy = _strategy(n)
            for config in args.configs:
                counts, formula = measure(config, model_name, n, strategy)
                ops = ", ".join(f"{k} {v['ops']}" for k, v in sorted(counts.items()))
                handed = sum(v["handed"] for v in counts.values())
                sent = sum(v["sent"] for v in counts.values())
                # The loss, metrics and float16 verdicts: 64 bytes or less each.
                small = sum(
                    ring_sent(k, b, n) for k, v in counts.items() for b in v["sizes"] if b <= 64
                )
                print(f"| {model_name} | {n} | {config} | {ops} | {handed / kib:.2f} | "
                      f"{sent / kib:.2f} | {small / kib:.3f} | {formula / kib:.2f} | "
                      f"{sent / formula:.5f} |")
                sys.stdout.flush()


if __name__ == "__main__":
    main()
