"""A `.keras` file saved by an earlier keras_comm still loads.

`fixtures/comm_layers_model.keras` (beside this file) was written by
`fixtures/make_comm_layers_model.py` at the keras_comm commit named in
`comm_layers_model_configs.json`. It holds many keras_comm layers and
parallel layers; loading it with today's code must give the same layers, the
same weights and the same predictions (outside any strategy every layer is
its unsplit self).
"""

import json
import pathlib

import keras
import numpy as np

import keras_comm  # noqa: F401  (registers the serializable layers)

FIXTURES = pathlib.Path(__file__).parent / "fixtures"

# Config keys renamed after the fixture was saved: old key -> new key. A
# rename must still load the old key (from_config accepts it).
RENAMED_KEYS = {
    "mean_flag": "mean",  # AllGather and the mirror layers, like ParallelOptimizer's `mean`
}


def _load():
    model = keras.saving.load_model(FIXTURES / "comm_layers_model.keras")
    io = np.load(FIXTURES / "comm_layers_model_io.npz")
    saved = json.loads((FIXTURES / "comm_layers_model_configs.json").read_text())["layers"]
    return model, io, saved


def test_saved_model_loads_and_predicts_the_same():
    model, io, _ = _load()
    y = model.predict([io["tokens"], io["feats"]], verbose=0)
    np.testing.assert_allclose(y, io["y"], rtol=1e-6, atol=1e-6)


def test_saved_layers_keep_their_classes_and_configs():
    model, _, saved = _load()
    for name, entry in saved.items():
        layer = model.get_layer(name)
        assert type(layer).__name__ == entry["class"], name
        config = json.loads(json.dumps(layer.get_config(), default=str))
        for key, value in entry["config"].items():
            key = RENAMED_KEYS.get(key, key)
            assert config.get(key) == value, (name, key, config.get(key), value)
        # The reloaded layer round-trips through its own config.
        again = type(layer).from_config(layer.get_config())
        assert again.get_config() == layer.get_config(), name
