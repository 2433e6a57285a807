"""A worker that forgets the strategy (tests/test_misuse.py).

Run by `run_cluster` under keras-comm-run: trains a model with an AllReduce
layer with `model.fit` and no tf.distribute strategy, as a user who forgot
`strategy.scope()` would, and reports the warnings it saw.
"""

import warnings

import numpy as np
import keras

from keras_comm import layers

from _cluster import finish, write_result

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model = keras.Sequential([keras.Input((4,)), layers.AllReduce(), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model.fit(np.ones((8, 4), "float32"), np.ones((8, 1), "float32"), epochs=2, verbose=0)
    model.predict(np.ones((2, 4), "float32"), verbose=0)

write_result({
    "warnings": [str(w.message) for w in caught if "outside any tf.distribute" in str(w.message)],
})
finish()
