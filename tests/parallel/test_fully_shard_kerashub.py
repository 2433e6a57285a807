"""`keras_comm.parallel.fully_shard` on KerasHub models, in one process.

GPT-2, Llama and Gemma causal LMs (tiny configs, random weights) sharded in
place over 2 logical-device replicas, trained on global batches and
compared with the same model trained alone
(tests/parallel/fully_shard_kerashub_worker.py, which also runs across real
processes); the in-place wrapping itself; and the errors.
"""

import keras
import numpy as np
import pytest

from keras_comm import parallel as P
from conftest import make_strategy
import distribution_worker as W
import fully_shard_kerashub_worker as cases

RTOL = 1e-5

pytest.importorskip("keras_hub")


@pytest.mark.inprocess
@pytest.mark.parametrize("name", cases.MODELS)
def test_kerashub_causal_lm_fully_sharded_matches_one_process(name, tmp_path, kerashub_references):
    """Start, losses, final weights (<= 1e-5 relative), predict and
    generate equal the model trained alone; every replica stores 1/2 of
    every weight and of Adam's slots; .weights.h5 files go both ways."""
    out = cases.train_and_compare(
        make_strategy(2), name, tmp=str(tmp_path), reference_dir=kerashub_references
    )
    print(name, out)
    assert not cases.check(out, RTOL, 2), (name, out)


@pytest.mark.inprocess
def test_llama_under_sgd_matches_one_process(tmp_path, kerashub_references):
    out = cases.train_and_compare(
        make_strategy(2), "llama", tmp=str(tmp_path), optimizer="sgd", reference_dir=kerashub_references
    )
    print(out)
    assert not cases.check(out, RTOL, 2), out


@pytest.mark.inprocess
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_model_built_in_deferred_weights_is_never_whole(name, tmp_path, kerashub_references):
    """Built inside `deferred_weights()`, no weight is allocated before
    `fully_shard`, which creates each as its shards with the values the
    model built whole gets from the same seed; training then matches."""
    out = cases.train_and_compare(
        make_strategy(2), name, tmp=str(tmp_path), deferred=True, reference_dir=kerashub_references
    )
    print(name, out)
    assert out["unallocated_before_sharding"] is True
    assert out["initial"] == 0.0, out
    assert not cases.check(out, RTOL, 2), (name, out)


@pytest.mark.inprocess
def test_in_place_wrapping_keeps_the_models_structure():
    """Every layer owning weights is wrapped where it stands: in the
    backbone's graph and as the attributes the task's `generate()` calls;
    the weight order and paths stay the unwrapped model's."""
    strategy = make_strategy(2)
    ref = W.gpt2()
    with strategy.scope():
        model = W.gpt2()
        P.fully_shard(model)
    backbone = model.backbone
    assert isinstance(backbone.token_embedding, P.FullyShard)
    assert isinstance(backbone.layer_norm, P.FullyShard)
    assert backbone.token_embedding in backbone.layers and backbone.token_embedding in model.layers
    block = backbone.transformer_layers[0]
    assert not isinstance(block, P.FullyShard)
    assert isinstance(block._feedforward_output_dense, P.FullyShard)
    assert isinstance(block._self_attention_layer._query_dense, P.FullyShard)
    assert len(P.fully_sharded.fully_sharded_layers(model)) == 19
    # No full-size weight is left anywhere in the model: each holds its half.
    full = P.full_weights(model)
    assert [np.shape(w) for w in full] == [np.shape(w) for w in ref.get_weights()]
    assert len(model.weights) == len(ref.weights)
    assert all(int(np.prod(v.shape)) <= -(-int(np.prod(np.shape(w))) // 2)
               for v, w in zip(model.weights, full))


@pytest.mark.inprocess
def test_a_model_sharded_twice_is_refused():
    strategy = make_strategy(2)
    with strategy.scope():
        model = W.gpt2()
        P.fully_shard(model)
        with pytest.raises(ValueError, match=r"holds FullyShard layers already.*Received: \d+"):
            P.fully_shard(model)


@pytest.mark.inprocess
def test_a_layer_owning_weights_and_weighted_sublayers_is_named():
    class Mixed(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.inner = keras.layers.Dense(3, name="inner")

        def build(self, shape):
            self.scale = self.add_weight(shape=(3,), initializer="ones", name="scale")
            self.inner.build(shape)

        def call(self, x):
            return self.inner(x) * self.scale

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.mixed = Mixed(name="mixed")

        def call(self, x):
            return self.mixed(x)

    strategy = make_strategy(2)
    with strategy.scope():
        net = Net()
        net(np.zeros((2, 4), "float32"))
        with pytest.raises(ValueError, match=r"layer 'mixed' owns weights \('(net/)?mixed/scale'\).*Received: layer=Mixed"):
            P.fully_shard(net)


@pytest.mark.inprocess
def test_an_unbuilt_model_is_refused():
    with pytest.raises(ValueError, match="takes a built Keras model.*Received: model="):
        P.fully_shard(keras.Sequential([keras.layers.Dense(2)]))
