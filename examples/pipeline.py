"""Pipeline parallelism: a 4-block digits classifier split into stages, trained with model.fit.

Run it on 4 local worker processes (one block per stage), on 3 (1, 1 and 2
blocks: stages of unequal size) or on 2 (two blocks per stage):

    keras-comm-run -n 4 examples/pipeline.py --micro-batches 4
    keras-comm-run -n 3 examples/pipeline.py --micro-batches 4 --batch-size 48
    keras-comm-run -n 2 examples/pipeline.py --micro-batches 4 --schedule gpipe

`keras_comm.parallel.Pipeline(stages, num_micro_batches, schedule)` is one
layer of the model. Worker s holds only stage s's weights (one flat buffer
the size of the largest stage: print it with --show-memory) and runs only
stage s: each global batch is cut into --micro-batches pieces that flow
through the stages by Send/Receive, with their gradients sent back in
reverse. With `schedule="1f1b"` (the default) and the pipeline as the
model's last layer, `fit` interleaves one forward and one backward per
micro-batch on every stage (at most 4 micro-batches in flight per stage);
`gpipe` runs every forward, then every backward. Either way one optimizer
update uses the gradient of the whole global batch, so the chief then
trains the same 4 blocks as one ordinary model in one process on the same
batches and prints both test accuracies.
"""

import time

import _common

BLOCKS = 4


def parse_args(argv=None):
    p = _common.parser(__doc__, epochs=15, batch_size=64, learning_rate=3e-3)
    p.add_argument("--hidden", type=int, default=64, help="units of each hidden block (the activations sent between stages)")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per global batch")
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b", help="the pipeline schedule")
    p.add_argument("--show-memory", action="store_true", help="print each worker's weight bytes")
    return _common.parse(p, argv, positive=("epochs", "batch_size", "hidden", "micro_batches"))


def blocks(hidden):
    """The model's 4 blocks: 3 hidden layers and the classifier."""
    import keras

    return [keras.layers.Dense(hidden, activation="relu") for _ in range(BLOCKS - 1)] + [keras.layers.Dense(10)]


def compile_model(model, learning_rate):
    import keras

    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def build_pipeline_model(hidden, num_stages, micro_batches, schedule, learning_rate):
    """The 4 blocks as `num_stages` stages (Sequentials of consecutive blocks, as equal as can be)."""
    import keras

    import keras_comm.parallel

    layers = blocks(hidden)
    # 4 stages: a block each; 3: 1, 1 and 2 blocks; 2: 2 and 2.
    bounds = [s * BLOCKS // num_stages for s in range(num_stages + 1)]
    stages = [keras.Sequential(layers[bounds[s]:bounds[s + 1]]) for s in range(num_stages)]
    pipeline = keras_comm.parallel.Pipeline(stages, num_micro_batches=micro_batches, schedule=schedule)
    return compile_model(keras.Sequential([keras.Input((64,)), pipeline]), learning_rate)


def build_reference_model(hidden, learning_rate):
    import keras

    return compile_model(keras.Sequential([keras.Input((64,))] + blocks(hidden)), learning_rate)


def main(argv=None):
    args = parse_args(argv)
    _common.quiet_tensorflow()
    import numpy as np
    import tensorflow as tf

    import keras_comm.parallel

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    n = strategy.num_replicas_in_sync
    if not 2 <= n <= BLOCKS:
        raise SystemExit(f"pipeline.py splits {BLOCKS} blocks into one stage per worker: run it on 2 to {BLOCKS}. Received: {n} replicas")
    if args.batch_size % (n * args.micro_batches):
        raise SystemExit(
            f"--batch-size must be divisible by replicas x --micro-batches ({n} x {args.micro_batches}). "
            f"Received: {args.batch_size}"
        )
    chief = _common.chief_rank(strategy) == 0
    x_train, x_test, y_train, y_test = _common.load_digits(args.seed, train_samples=args.train_samples)
    # Every worker of the pipeline holds equally many samples of each batch,
    # so the last, partial training batch is dropped and the test set
    # (trimmed to a multiple of the micro-batch split) is one batch.
    train = _common.global_batches(x_train, y_train, args.batch_size, drop_remainder=True)
    keep = len(x_test) - len(x_test) % (n * args.micro_batches)
    test = _common.global_batches(x_test[:keep], y_test[:keep], keep)

    with strategy.scope():
        model = build_pipeline_model(args.hidden, n, args.micro_batches, args.schedule, args.learning_rate)
    reference = build_reference_model(args.hidden, args.learning_rate)
    reference.set_weights(keras_comm.parallel.full_weights(model))  # every worker takes part
    layer = model.layers[-1]
    if args.show_memory:
        (buffer,) = model.trainable_variables
        rank = _common.chief_rank(strategy)
        print(f"worker {rank}: stage {rank} holds {layer.stage_nbytes(rank)} bytes of weights "
              f"(buffer {int(np.prod(buffer.shape)) * 4} bytes; the whole model "
              f"{sum(layer.stage_nbytes(s) for s in range(n))})", flush=True)
    if chief:
        print(
            f"Training {BLOCKS} blocks as a {n}-stage {args.schedule} pipeline on {len(x_train)} digits, "
            f"global batch {args.batch_size} in {args.micro_batches} micro-batches.",
            flush=True,
        )
    start = time.time()
    model.fit(train, epochs=args.epochs, shuffle=False, verbose=2 if chief else 0)
    seconds = time.time() - start
    _, accuracy = model.evaluate(test, verbose=0)
    results = {"replicas": n, "accuracy": float(accuracy), "seconds": seconds}
    full = keras_comm.parallel.full_weights(model)

    _common.compare_fit(args, chief, results, full, reference, train, test)
    _common.report(args, "accuracy", results, chief)
    return _common.finish(strategy)


if __name__ == "__main__":
    raise SystemExit(main())
