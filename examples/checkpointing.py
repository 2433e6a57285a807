"""Checkpointing and resuming a multi-worker fit: interrupted, resumed, exact.

Run it on 2 local worker processes:

    keras-comm-run -n 2 examples/checkpointing.py
    keras-comm-run -n 2 examples/checkpointing.py --fully-shard

The digits MLP trains with two of Keras's callbacks, as a script on a cluster
would:

- `keras_comm.callbacks.BackupAndRestore(backup_dir, save_freq=N)` backs the
  training state up every N steps (the chief writes, every worker takes
  part);
- `keras.callbacks.ModelCheckpoint("model-{epoch}.keras")` keeps a model file
  per epoch (the chief's is the one kept).

Midway through an epoch every worker stops (a callback raises, as a
preemption would end the job). The script then builds a fresh model, as a
restarted job would, and calls the same `fit` again: BackupAndRestore
restores the last backup and resumes at its step. The chief finally trains
the model uninterrupted in one process on the same global batches and prints
both test accuracies and how far the weights are apart (float32 round-off),
and loads the last `.keras` file in one process, without a strategy.

With `--fully-shard` the model is `keras_comm.parallel.fully_shard`ed: every
weight is split over the workers, every save gathers it (a collective), and
the files hold the unwrapped model's full-size weights.

The files go to `--workdir`, which every worker must see (on one machine, any
local directory; on a cluster, shared storage). By default, a directory under
the system's temporary directory named after the job's first worker address.
"""

import hashlib
import json
import os
import shutil
import tempfile

import _common


def parse_args(argv=None):
    p = _common.parser(__doc__, epochs=6, batch_size=64, learning_rate=3e-3)
    p.add_argument("--hidden", type=int, default=64, help="hidden units")
    p.add_argument("--save-freq", type=int, default=4, help="BackupAndRestore: a backup every this many steps")
    p.add_argument(
        "--interrupt-at", type=int, nargs=2, default=None, metavar=("EPOCH", "STEP"),
        help="stop every worker after this step of this epoch (0-based; default: "
             "the middle step of the middle epoch)",
    )
    p.add_argument("--fully-shard", action="store_true", help="split every weight over the workers (ZeRO-3)")
    p.add_argument("--workdir", default=None, help="directory for the backups and model files, seen by every worker")
    return _common.parse(p, argv, positive=("epochs", "batch_size", "hidden", "save_freq"))


def default_workdir():
    """A directory name every worker of this job computes alike: from TF_CONFIG's first worker."""
    cluster = json.loads(os.environ.get("TF_CONFIG", "{}")).get("cluster", {})
    first = (cluster.get("chief") or cluster.get("worker") or ["single"])[0]
    tag = hashlib.sha256(first.encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), f"keras_comm_checkpointing_{tag}")


def build_model(hidden, learning_rate, seed):
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    return _common.compile_classifier(model, learning_rate)


def main(argv=None):
    args = parse_args(argv)
    _common.quiet_tensorflow()
    import keras
    import tensorflow as tf

    import keras_comm.callbacks
    import keras_comm.parallel

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    n = strategy.num_replicas_in_sync
    chief = _common.chief_rank(strategy) == 0
    train_samples, train, test = _common.equal_share_digits(args, n)
    steps = train_samples // args.batch_size
    epoch, step = args.interrupt_at or (args.epochs // 2, steps // 2)
    if not (0 <= epoch < args.epochs and 0 <= step < steps):
        raise SystemExit(
            f"--interrupt-at must name a step of the run: epoch < {args.epochs}, step < {steps}. "
            f"Received: {epoch} {step}"
        )

    workdir = args.workdir or default_workdir()
    backup_dir = os.path.join(workdir, "backup")
    if chief:
        shutil.rmtree(workdir, ignore_errors=True)  # a fresh run
    _common.finish(strategy)  # every worker waits until the chief has cleaned up

    def make_model(seed):
        """The model, under the strategy's scope; `seed` differs to show the restore."""
        plain = build_model(args.hidden, args.learning_rate, seed)
        with strategy.scope():
            if args.fully_shard:
                return plain, _common.compile_classifier(keras_comm.parallel.fully_shard(plain), args.learning_rate)
            return plain, build_model(args.hidden, args.learning_rate, seed)

    def callbacks():
        return [
            keras_comm.callbacks.BackupAndRestore(backup_dir, save_freq=args.save_freq),
            keras.callbacks.ModelCheckpoint(os.path.join(workdir, "model-{epoch}.keras")),
        ]

    class Preempted(Exception):
        pass

    class StopAt(keras.callbacks.Callback):
        """Stops every worker after one step, as a preemption would."""

        def on_epoch_begin(self, e, logs=None):
            self.epoch = e

        def on_train_batch_end(self, batch, logs=None):
            if (self.epoch, batch) == (epoch, step):
                raise Preempted(f"stopped after step {step} of epoch {epoch}")

    reference, model = make_model(args.seed)
    if chief:
        print(f"Training on {train_samples} digits with {n} replicas; a backup every "
              f"{args.save_freq} steps, stopping after step {step} of epoch {epoch}.", flush=True)
    try:
        model.fit(train, epochs=args.epochs, shuffle=False, verbose=0, callbacks=[StopAt(), *callbacks()])
        raise RuntimeError("fit ended without reaching --interrupt-at")
    except Preempted as stop:
        if chief:
            print(f"{stop}; resuming with a fresh model", flush=True)

    # A restarted job: a new model (other initial weights), the same callbacks.
    _, model = make_model(args.seed + 1)
    backup, checkpoint = callbacks()
    model.fit(train, epochs=args.epochs, shuffle=False, verbose=0, callbacks=[backup, checkpoint])
    if chief:
        print(f"resumed from the backup of epoch {backup.restored['epoch']}, "
              f"step {backup.restored['step']}", flush=True)
    _, accuracy = model.evaluate(test, verbose=0)
    weights = keras_comm.parallel.full_weights(model) if args.fully_shard else model.get_weights()
    results = {"replicas": n, "accuracy": float(accuracy), "resumed_at": backup.restored}

    last = os.path.join(workdir, f"model-{args.epochs}.keras")
    if chief:
        # The chief's file holds full-size weights; it loads in one process.
        if args.fully_shard:
            loaded = build_model(args.hidden, args.learning_rate, args.seed + 2)
            loaded.optimizer.build(loaded.trainable_variables)  # to take the file's Adam state too
            loaded.load_weights(last)  # the sharded model's file, into the unwrapped model
        else:
            loaded = keras.models.load_model(last)
        results["checkpoint_max_rel_diff"] = _common.max_rel_diff(loaded.get_weights(), weights)
        print(f"{os.path.basename(last)} loads in one process; its weights are "
              f"{results['checkpoint_max_rel_diff']:.1e} from the trained ones", flush=True)
    # Uninterrupted, in one process, from the same initial weights.
    _common.compare_fit(args, chief, results, weights, reference, train, test)
    _common.report(args, "accuracy", results, chief)
    status = _common.finish(strategy)
    if chief:
        shutil.rmtree(workdir, ignore_errors=True)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
