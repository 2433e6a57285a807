"""Data-parallel training of a digits classifier with model.fit across workers.

Run it on 2 local worker processes (the launcher sets TF_CONFIG):

    keras-comm-run -n 2 examples/data_parallel.py
    keras-comm-run -n 2 examples/data_parallel.py --accumulation-steps 2 --zero-stage 1

Each worker trains the same model on its share of every global batch; the
chief (rank 0) then trains the same model in a single process on the same
global batches and prints both accuracies. With keras_comm's exact
multi-worker fit they agree to float32 round-off.

`--accumulation-steps k` and `--zero-stage {0,1,2}` add
`keras_comm.callbacks.ParallelOptimizer`: one optimizer step every k global
batches (a batch of k x --batch-size), and the optimizer state sharded over
the workers (ZeRO-1), plus the accumulation buffer (ZeRO-2). The
single-process reference uses the same callback, so the two runs still take
identical steps.

The data is scikit-learn's handwritten digits (1,797 8x8 images), which ships
inside the scikit-learn package: nothing is downloaded.
"""

import time

import _common


def parse_args(argv=None):
    p = _common.parser(__doc__, epochs=15, batch_size=64, learning_rate=3e-3)
    p.add_argument("--hidden", type=int, default=64, help="hidden units")
    p.add_argument(
        "--accumulation-steps", type=int, default=1,
        help="global batches per optimizer step (ParallelOptimizer); 1 = every batch",
    )
    p.add_argument(
        "--zero-stage", type=int, default=0, choices=(0, 1, 2),
        help="ParallelOptimizer ZeRO stage: 0 none, 1 optimizer state, 2 also gradient buffers",
    )
    return _common.parse(p, argv, positive=("epochs", "batch_size", "hidden", "accumulation_steps"))


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
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def callbacks(args):
    """ParallelOptimizer when asked for; plain fit otherwise."""
    import keras_comm

    if args.accumulation_steps == 1 and args.zero_stage == 0:
        return []
    return [
        keras_comm.callbacks.ParallelOptimizer(
            accumulation_steps=args.accumulation_steps, zero_stage=args.zero_stage
        )
    ]


def main(argv=None):
    args = parse_args(argv)
    _common.quiet_tensorflow()
    import tensorflow as tf

    import keras_comm  # noqa: F401  (makes model.fit work under MWMS)

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    chief = _common.chief_rank(strategy) == 0
    x_train, x_test, y_train, y_test = _common.load_digits(args.seed, train_samples=args.train_samples)
    train = _common.global_batches(x_train, y_train, args.batch_size)
    test = _common.global_batches(x_test, y_test, args.batch_size)

    with strategy.scope():
        model = build_model(args.hidden, args.learning_rate, args.seed)
    if chief:
        print(
            f"Training on {len(x_train)} digits with {strategy.num_replicas_in_sync} replicas, "
            f"global batch {args.batch_size}, accumulation steps {args.accumulation_steps}, "
            f"ZeRO stage {args.zero_stage}.",
            flush=True,
        )
    cbs = callbacks(args)
    start = time.time()
    model.fit(train, epochs=args.epochs, shuffle=False, verbose=2 if chief else 0, callbacks=cbs)
    seconds = time.time() - start
    _, accuracy = model.evaluate(test, verbose=0)
    results = {"replicas": strategy.num_replicas_in_sync, "accuracy": float(accuracy), "seconds": seconds}
    if cbs:
        results["state_bytes_per_replica"] = int(cbs[0].state_bytes())
        if chief:
            print(f"optimizer state held by each replica: {results['state_bytes_per_replica']} bytes", flush=True)

    if chief and not args.no_reference:
        # The same model on the same global batches, in this process alone.
        single = build_model(args.hidden, args.learning_rate, args.seed)
        single.fit(train, epochs=args.epochs, shuffle=False, verbose=0, callbacks=callbacks(args))
        _, reference = single.evaluate(test, verbose=0)
        results["single_process_accuracy"] = float(reference)
        results["max_weight_rel_diff"] = _common.max_rel_diff(model.get_weights(), single.get_weights())
    _common.report(args, "accuracy", results, chief)
    return _common.finish(strategy)


if __name__ == "__main__":
    raise SystemExit(main())
