"""KerasHub GPT-2 on N workers: peak RSS and step time, fully sharded vs data parallel.

One mode per launch (a process's high-water mark only grows):

    python -m keras_comm_run -n 2 -m benchmarks.kerashub_fsdp --mode plain
    python -m keras_comm_run -n 2 -m benchmarks.kerashub_fsdp --mode fully_shard
    python -m keras_comm_run -n 2 -m benchmarks.kerashub_fsdp --mode deferred

Modes: ``plain`` (the model built under the strategy: data parallel),
``fully_shard`` (built whole, then `keras_comm.parallel.fully_shard` in
place), ``deferred`` (built inside `keras_comm.parallel.deferred_weights()`,
then sharded: never whole). Each worker prints one JSON line: its resident
memory high-water mark (``ru_maxrss``) before the model, after building (and
sharding) it, and after `fit`, and the median step time over the steps after
the first (the first traces).
"""

import argparse
import json
import resource
import time

import keras
import numpy as np
import tensorflow as tf

import keras_comm
from keras_comm import parallel

CONFIG = dict(
    vocabulary_size=8192, num_layers=4, num_heads=4, hidden_dim=256,
    intermediate_dim=1024, max_sequence_length=64, dropout=0.0,
)


def peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class StepClock(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.times = []

    def on_train_batch_begin(self, batch, logs=None):
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self.t0)


def build(mode):
    import keras_hub

    keras.utils.set_random_seed(1)
    if mode == "deferred":
        with parallel.deferred_weights():
            backbone = keras_hub.models.GPT2Backbone(**CONFIG)
            model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    else:
        backbone = keras_hub.models.GPT2Backbone(**CONFIG)
        model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    if mode != "plain":
        parallel.fully_shard(model)
    return model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["plain", "fully_shard", "deferred"], required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    before = peak_mib()
    with strategy.scope():
        model = build(args.mode)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=False,
        )
    built = peak_mib()
    rng = np.random.RandomState(0)
    seq = CONFIG["max_sequence_length"]
    n = args.batch * args.steps
    tokens = rng.randint(1, CONFIG["vocabulary_size"], size=(n, seq + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((n, seq), "bool")}
    clock = StepClock()
    model.fit(x, tokens[:, 1:], batch_size=args.batch, epochs=1, shuffle=False, verbose=0,
              callbacks=[clock])
    params = sum(int(np.prod(np.shape(w))) for w in parallel.full_weights(model))
    stored = sum(int(np.prod(v.shape)) for v in model.weights)
    print(json.dumps({
        "mode": args.mode,
        "rank": keras_comm.topology.task_id(strategy),
        "params": params,
        "stored_params": stored,
        "rss_before_mib": round(before),
        "rss_after_build_mib": round(built),
        "rss_after_fit_mib": round(peak_mib()),
        "median_step_s": round(float(np.median(clock.times[1:])), 4),
    }), flush=True)


if __name__ == "__main__":
    main()
