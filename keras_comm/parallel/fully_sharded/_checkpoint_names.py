"""Where a `FullyShard` layer's weights go in a Keras file, and how they get there.

A `FullyShard` writes its inner layer's structure (its variables at its own
path, its sublayers' below it), every weight full-size, gathered from the
shards; so the file is what the unwrapped model holds and loads. Keras names
a file's entries after the layers' classes ("fully_shard", "dense_1"); a
wrapper given `checkpoint_name` writes and reads its entry under that name
(`keras_comm.parallel.set_checkpoint_names` gives every wrapper of a model
the name the unwrapped model uses).
"""


import re

import keras
import numpy as np

from keras_comm._private import keras_api


# Keras's name for a FullyShard in a layer list: its class in snake case,
# numbered per class (keras.src.saving.saving_lib._save_container_state).
LIST_ENTRY = re.compile(r"fully_shard(_[0-9]+)?")


def store_has(store, path):
    has_path = getattr(store, "has_path", None)  # Keras >= 3.12
    if has_path is not None:
        return has_path(path)
    return path in store.h5_file


class CheckpointEntry:
    """The saving half of `FullyShard` (a mixin: `FullyShard` holds the state)."""

    def _entry_path(self, path):
        """The unwrapped model's entry for this layer: `path`'s last part
        replaced by `checkpoint_name` when `path` is an entry of a layer
        list (Keras's class-based "fully_shard_1"); None otherwise (a layer
        saved under an attribute's name, which the unwrapped model shares)."""
        if self.checkpoint_name is None:
            return None
        parent, _, last = path.rpartition("/")
        if not LIST_ENTRY.fullmatch(last):
            return None
        return f"{parent}/{self.checkpoint_name}" if parent else self.checkpoint_name

    def save_own_variables(self, store):
        inner = self._hidden.layer
        values = self.full_weights()
        path = keras_api.weights_store_path(store)
        entry = self._entry_path(path)
        if entry is not None:
            path = entry
            # Repositions the store, as Keras's own walk does per layer.
            store.make(path, metadata={"name": inner.name})
        with keras.StatelessScope(
            state_mapping=list(zip(inner.weights, values)), initialize_variables=False
        ):
            inner.save_own_variables(store)
            keras_api.save_children(inner, store, path)

    def load_own_variables(self, store):
        inner = self._hidden.layer
        path = keras_api.weights_store_path(store)
        entry = self._entry_path(path)
        if entry is not None and store_has(store, entry):
            path = entry
            store.get(path)
        with keras.StatelessScope(initialize_variables=False) as scope:
            inner.load_own_variables(store)
            keras_api.load_children(inner, store, path)
            values = [scope.get_current_value(w) for w in inner.weights]
        missing = [w.path for w, v in zip(inner.weights, values) if v is None]
        if missing:
            raise ValueError(
                f"FullyShard {self.name!r}: the file holds no value for "
                f"{missing[0]!r} (was it written by another architecture?). "
                f"Received: {len(missing)} weights missing"
            )
        self.set_full_weights([np.asarray(v) for v in values])
