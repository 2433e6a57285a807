"""Pipeline parallelism: a two-stage digits classifier with Send/Receive and micro-batches.

Run it on 2 local worker processes:

    keras-comm-run -n 2 examples/pipeline.py --micro-batches 4

Stage 1 (a hidden layer) runs on rank 0, stage 2 (the classifier) on rank
1. Every worker runs the same model (SPMD):

    stage1 -> Send(dest=1, src=0) -> Receive(src=0, dest=1) -> stage2

`Send` is active on rank 0 only and `Receive` on rank 1 only: rank 1 throws
away its own stage-1 output and continues from the activations rank 0
sent. Only rank 1's loss counts (rank 0's is multiplied by 0). Backward,
Receive sends the activation gradient back to rank 0, where Send adds it
into stage 1's backward pass: each stage's weights get exactly the gradient
of the whole model.

Each global batch is cut into --micro-batches pieces; one step runs every
micro-batch forward, then every micro-batch backward (GPipe's schedule),
and applies one optimizer update for the whole batch. The chief then trains
the same two layers as one ordinary model in one process on the same
batches and prints both test accuracies.

Weights here are mirrored: each worker holds both stages (the stage it does
not run gets a zero gradient there, and the optimizer's all-reduce adds the
other worker's real one). That keeps the example short; a memory-saving
pipeline keeps each stage's weights on its own worker only.
`keras_comm.parallel.PipelineStage(first, second, num_micro_batches)`
packages the same pattern as one layer that trains with `model.fit`.
"""

import time

import _common


def parse_args(argv=None):
    p = _common.parser(__doc__, epochs=15, batch_size=64, learning_rate=3e-3)
    p.add_argument("--hidden", type=int, default=64, help="units of stage 1 (the activations sent between stages)")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per global batch")
    return _common.parse(p, argv, positive=("epochs", "batch_size", "hidden", "micro_batches"))


def stage1(hidden):
    import keras

    return keras.layers.Dense(hidden, activation="relu", name="stage1")


def stage2():
    import keras

    return keras.layers.Dense(10, name="stage2")


def build_pipeline_model(hidden):
    """Both stages, with the hand-over from rank 0 to rank 1 between them."""
    import keras

    import keras_comm.layers

    inputs = keras.Input((64,))
    h = stage1(hidden)(inputs)
    h = keras_comm.layers.Send(dest=1, src=0, name="send_activations")(h)
    h = keras_comm.layers.Receive(src=0, dest=1, shape=(None, hidden), name="receive_activations")(h)
    return keras.Model(inputs, stage2()(h))


def build_reference_model(hidden, seed):
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((64,))
    return keras.Model(inputs, stage2()(stage1(hidden)(inputs)))


def make_optimizer(learning_rate):
    import keras

    return keras.optimizers.Adam(learning_rate)


def summed_cross_entropy(labels, logits):
    import keras

    return keras.ops.sum(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))


def accuracy(labels, logits):
    import keras

    return float(keras.ops.mean(keras.ops.cast(keras.ops.argmax(logits, -1) == labels, "float32")))


def micro_batches(x, y, batch_size, count):
    """Global batches, each as `count` micro-batches (the last may be smaller)."""
    import numpy as np

    for i in range(0, len(x), batch_size):
        xb, yb = x[i:i + batch_size], y[i:i + batch_size]
        count_here = min(count, len(xb))
        yield np.array_split(xb, count_here), np.array_split(yb, count_here), len(xb)


def train_pipeline(model, optimizer, strategy, args, x, y):
    import tensorflow as tf

    import keras_comm

    last_stage = 1

    def replica_step(xs, ys, batch_len):
        # Only the last stage's loss is the model's loss.
        weight = 1.0 if keras_comm.rank() == last_stage else 0.0
        with tf.GradientTape() as tape:
            loss = 0.0
            for xm, ym in zip(xs, ys):  # every micro-batch forward ...
                loss += summed_cross_entropy(ym, model(xm, training=True))
            loss = weight * loss / tf.cast(batch_len, "float32")
        # ... then every micro-batch backward, and one update.
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    step = tf.function(lambda xs, ys, n: strategy.run(replica_step, args=(xs, ys, n)))
    for epoch in range(args.epochs):
        # Rank 1 holds the loss; the losses of all replicas sum to it.
        losses = [
            strategy.reduce("sum", step(xs, ys, n), axis=None)
            for xs, ys, n in micro_batches(x, y, args.batch_size, args.micro_batches)
        ]
        yield epoch, float(sum(losses)) / len(losses)


def evaluate_pipeline(model, strategy, x, y):
    import tensorflow as tf

    import keras_comm

    def logits_on_last_stage(images):
        logits = model(images, training=False)
        # Rank 1 has the real logits: share them with every rank.
        mask = 1.0 if keras_comm.rank() == 1 else 0.0
        return tf.distribute.get_replica_context().all_reduce("sum", mask * logits)

    logits = tf.function(lambda t: strategy.run(logits_on_last_stage, args=(t,)))(x)
    return accuracy(y, strategy.experimental_local_results(logits)[0])


def train_reference(model, optimizer, args, x, y):
    import tensorflow as tf

    @tf.function
    def step(images, labels):
        with tf.GradientTape() as tape:
            loss = summed_cross_entropy(labels, model(images, training=True)) / tf.cast(tf.shape(labels)[0], "float32")
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    for _ in range(args.epochs):
        for i in range(0, len(x), args.batch_size):
            step(x[i:i + args.batch_size], y[i:i + args.batch_size])


def main(argv=None):
    args = parse_args(argv)
    _common.quiet_tensorflow()
    import tensorflow as tf

    import keras_comm  # noqa: F401

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    n = strategy.num_replicas_in_sync
    if n != 2:
        raise SystemExit(f"pipeline.py has two stages and runs on 2 replicas. Received: {n} replicas")
    chief = _common.chief_rank(strategy) == 0
    x_train, x_test, y_train, y_test = _common.load_digits(args.seed)

    reference = build_reference_model(args.hidden, args.seed)
    with strategy.scope():
        model = build_pipeline_model(args.hidden)
        model.set_weights(reference.get_weights())
        optimizer = make_optimizer(args.learning_rate)
    if chief:
        print(
            f"Training a 2-stage pipeline on {len(x_train)} digits, global batch "
            f"{args.batch_size} in {args.micro_batches} micro-batches.",
            flush=True,
        )
    start = time.time()
    for epoch, loss in train_pipeline(model, optimizer, strategy, args, x_train, y_train):
        if chief:
            print(f"epoch {epoch + 1}/{args.epochs} - loss {loss:.4f}", flush=True)
    seconds = time.time() - start
    results = {"replicas": n, "accuracy": evaluate_pipeline(model, strategy, x_test, y_test), "seconds": seconds}

    if chief and not args.no_reference:
        train_reference(reference, make_optimizer(args.learning_rate), args, x_train, y_train)
        results["single_process_accuracy"] = accuracy(y_test, reference(x_test, training=False))
        results["max_weight_rel_diff"] = _common.max_rel_diff(model.get_weights(), reference.get_weights())
    _common.report(args, "accuracy", results, chief)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
