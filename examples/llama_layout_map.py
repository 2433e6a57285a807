"""A KerasHub Llama trained under its own keras.distribution layout map, across workers.

Run it on 2 (or 4) local worker processes:

    keras-comm-run -n 2 examples/llama_layout_map.py

The model is what KerasHub's documentation shows for JAX: a
`keras.distribution.DeviceMesh` with a "batch" and a "model" axis, the
`LayoutMap` that `keras_hub.models.LlamaBackbone.get_layout_map(mesh)`
returns, unchanged, and `keras.distribution.ModelParallel(...).scope()`;
on TensorFlow it is built inside a `MultiWorkerMirroredStrategy` scope too,
and `keras_comm.distribution.list_devices()` names the mesh's devices (the
job's replicas). Every weight the layout map splits is created directly as
this replica's block and gathered whole only while a layer uses it; Adam's
moments are blocks too. A tiny Llama with random weights trains on random
token sequences (nothing is downloaded). Each worker prints the bytes its
replica holds next to the unsplit model's; the chief then trains the same
model in one process on the same global batches and prints both test
losses and the largest relative weight difference.
"""

import time

import _common


def parse_args(argv=None):
    p = _common.parser(__doc__, epochs=2, batch_size=16, learning_rate=3e-3)
    p.add_argument("--model-axis", type=int, default=0,
                   help="size of the mesh's 'model' axis (0: every replica)")
    p.add_argument("--hidden", type=int, default=32, help="hidden size")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--sequence-length", type=int, default=16, help="tokens per sequence")
    return _common.parse(p, argv, positive=("epochs", "batch_size", "hidden", "layers"))


VOCAB = 128


def build_model(args):
    import keras
    import keras_hub

    keras.utils.set_random_seed(args.seed)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB, num_layers=args.layers, num_query_heads=4,
        num_key_value_heads=4, hidden_dim=args.hidden, intermediate_dim=2 * args.hidden,
        dropout=0.0,
    )
    model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    model.compile(
        optimizer=keras.optimizers.Adam(args.learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    return model


def token_batches(args, samples, seed, batch_size):
    """Global batches of random token sequences: next-token prediction."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.RandomState(seed)
    tokens = rng.randint(1, VOCAB, size=(samples, args.sequence_length + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((samples, args.sequence_length), bool)}
    ds = tf.data.Dataset.from_tensor_slices((x, tokens[:, 1:])).batch(batch_size, drop_remainder=True)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return ds.with_options(options), x


def main(argv=None):
    args = parse_args(argv)
    _common.quiet_tensorflow()
    import keras
    import keras_hub
    import numpy as np
    import tensorflow as tf

    import keras_comm

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    n = strategy.num_replicas_in_sync
    chief = _common.chief_rank(strategy) == 0
    model_axis = args.model_axis or n
    if n % model_axis or args.batch_size % n:
        raise SystemExit(
            f"--model-axis must divide the {n} replicas and --batch-size be divisible by "
            f"them. Received: --model-axis={model_axis}, --batch-size={args.batch_size}"
        )
    train, _ = token_batches(args, args.train_samples or 64, args.seed, args.batch_size)
    test, prompts = token_batches(args, 2 * n, args.seed + 1, 2 * n)

    reference = build_model(args)  # no strategy, no distribution: the unsplit model
    mesh = keras.distribution.DeviceMesh(
        (n // model_axis, model_axis), ("batch", "model"),
        devices=keras_comm.distribution.list_devices(strategy),
    )
    layout_map = keras_hub.models.LlamaBackbone.get_layout_map(mesh)
    distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    with strategy.scope(), distribution.scope():
        model = build_model(args)

    stored = sum(int(np.prod(v.value.shape)) * 4 for v in model.weights)
    whole = sum(int(np.prod(v.shape)) * 4 for v in model.weights)
    split = sum(keras_comm.distribution.is_sharded(v) for v in model.weights)
    print(
        f"worker {_common.chief_rank(strategy)}: each replica stores {stored} bytes of weights "
        f"(unsplit: {whole}); {split} of {len(model.weights)} weights split over the mesh "
        f"{tuple(mesh.shape)}",
        flush=True,
    )
    start = time.time()
    model.fit(train, epochs=args.epochs, shuffle=False, verbose=2 if chief else 0)
    seconds = time.time() - start
    loss = model.evaluate(test, verbose=0)
    with keras_comm.distribution.gathered(model):  # every worker takes part
        generated = model.generate(
            {k: v[:2] for k, v in prompts.items()}, max_length=args.sequence_length,
            stop_token_ids=None,
        )
    if chief:
        print("generated token ids:", np.asarray(generated["token_ids"])[0].tolist(), flush=True)
    results = {"replicas": n, "loss": float(loss), "seconds": seconds, "stored_bytes": stored,
               "unsplit_bytes": whole}
    full = model.get_weights()  # every worker takes part (gathers)
    if chief and not args.no_reference:
        reference.fit(train, epochs=args.epochs, shuffle=False, verbose=0)
        results["single_process_loss"] = float(reference.evaluate(test, verbose=0))
        results["max_weight_rel_diff"] = _common.max_rel_diff(full, reference.get_weights())
    _common.report(args, "loss", results, chief)
    return _common.finish(strategy)


if __name__ == "__main__":
    raise SystemExit(main())
