"""CPU cost per step of `BackupAndRestore(save_before_preemption=True)`.

`python benchmarks/preemption_overhead.py [--steps 300] [--trials 7]`: one
process, a 2-replica in-process MultiWorkerMirroredStrategy, one small model
per setting (traced once by a warm-up fit), then fits of `--steps` steps
alternating between the two settings; prints the median process CPU seconds
(user + sys) per step of each and their ratio. Both settings use
`BackupAndRestore(save_freq=10**9)` (no save happens), so the difference is
the option alone: the SIGTERM handler, and per step one check of a flag at
each batch's start and end. On real workers the option also starts one
thread that waits in the coordination service's key-value store (no CPU
while it waits).
"""

import argparse
import json
import resource
import statistics
import tempfile

import tensorflow as tf

cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_comm  # noqa: E402


def _cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--trials", type=int, default=7)
    args = parser.parse_args()
    strategy = tf.distribute.MultiWorkerMirroredStrategy._from_local_devices(["/cpu:0", "/cpu:1"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8 * args.steps, 5)).astype("float32")
    y = rng.normal(size=(8 * args.steps, 3)).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    models = {}
    for option in (False, True):
        keras.utils.set_random_seed(1)
        with strategy.scope():
            model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                                      keras.layers.Dense(3)])
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        models[option] = model

    def fit(option, take):
        with tempfile.TemporaryDirectory() as backup_dir:
            backup = keras_comm.callbacks.BackupAndRestore(
                backup_dir, save_freq=10**9, save_before_preemption=option)
            start = _cpu()
            models[option].fit(ds.take(take), epochs=1, verbose=0, callbacks=[backup])
            return _cpu() - start

    for option in (False, True):
        fit(option, 5)  # traces the step
    per_step = {False: [], True: []}
    for _ in range(args.trials):
        for option in (False, True):
            per_step[option].append(fit(option, args.steps) / args.steps)
    off, on = statistics.median(per_step[False]), statistics.median(per_step[True])
    print(json.dumps({
        "steps": args.steps, "trials": args.trials,
        "cpu_s_per_step_without": off, "cpu_s_per_step_with": on, "ratio": on / off,
        "all": {str(k): v for k, v in per_step.items()},
    }, indent=1))


if __name__ == "__main__":
    main()
