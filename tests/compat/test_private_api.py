"""The private Keras and TensorFlow code keras_comm relies on has not changed.

keras_comm reaches private Keras code only through
`keras_comm._private.keras_api` and private TensorFlow code only through
`keras_comm._private.tf_api`. This file guards both:

- the source of every private function they name (`relied_on()`) is hashed
  and compared with the hashes recorded below for the installed version;
- the private attributes they read exist on real objects;
- no other keras_comm module imports ``keras.src`` / ``tensorflow.python``
  or reads one of those private attributes.

A hash mismatch means upstream changed that code: read the new version,
port the change into the boundary module (or the code that relies on it, named
in its docstring), then record the new hashes here. Keras hashes were taken
from the released wheels of each version in `compat.SUPPORTED_KERAS`
(3.10.0, 3.11.3 and 3.12.4 also ran the in-process flows of test_compat.py).
"""

import hashlib
import inspect
import json
import pathlib
import re
import tokenize

import keras
import pytest
import tensorflow as tf

import keras_comm  # noqa: F401  (applies compat)
from keras_comm._private import keras_api
from keras_comm._private import tf_api

_KERAS_SHA256 = {
    "3.10.0": {
        "TensorFlowTrainer.make_predict_function": "5f1a30acee30e08cd41bd857387a80a8d7c05ee5d9a94095f06b0ec3978c6f49",
        "TensorFlowTrainer.predict": "6cf352a405e752a9a2a6b2427a6de07abbdfe59d6df0f1bf5697f0ea64a710b7",
        "TensorFlowTrainer._maybe_symbolic_build": "181752273e37d689f7dd4915f31a454130a3761290dc4b6d351465b85d4c6b81",
        "TensorFlowTrainer._make_function": "55eb952812cac1fbb9934e24de911532f45314c57ed6e6a53c9ebe88f392d2ff",
        "TensorFlowTrainer.train_step": "38eff65a3e8e64475bc46a4e655af968166c2909f8127cbf5d9466bdca1a0950",
        "TFOptimizer._all_reduce_sum_gradients": "dd8896fa68d7950159af19848d8b41d0c5dbd0c90ae0d82361faab0a987702ba",
        "TFOptimizer._backend_update_step": "00bd759c099a6b72e88785836a38006d3d197c329b14bf6e75b77339460d3bc3",
        "TFEpochIterator._get_iterator": "b986aa8a9d2264d9d07d284ec7cfcf2bd4ff6ebee6786029bb50a763603afd84",
        "EpochIterator._enumerate_iterator": "5b12fbb1202bfd361c4dee369c87fed90546eafbf1c6566991bbf0621776fd6f",
        "EpochIterator.reset": "b73c9f2daadc29b45b590086d2221bbbea3a1e6345ff20956e3c022457627af0",
        "TFEpochIterator.__next__": "bbaac0291856627f210c6bd72eb09e4f910175329b6f06fc708e881f9578a9b0",
        "Trainer._symbolic_build": "330210b83242a6af0c29890c4d2ca75bba8187399727dc3eb70c37643a1b45ec",
        "Trainer._compute_loss": "13153b89c765b0d6e50e8d688cdcfa0b384c29c53b3bb576e276dff7cd71369d",
        "Trainer.get_metrics_result": "0b283618592624ffa746c2d9a2e8bff7570ee8f794979d7befc3ca47b88d46f8",
        "Trainer._get_metrics_result_or_logs": "1c7ab4a2c8e618681cbebf091de56de691c84dcec0a8e3c9842693613c548cc5",
        "reduce_per_replica": "2e7d54b1e6edc29a8c6a7e6b66cd4c8be3ba7842412c93753ac3afe169fa7fb8",
        "_multi_worker_concat": "2137073bfe27fb922127c1fe2df6048501d78cd9fef3a6c32aadfd4a71d67974",
        "reduce_values": "60b0462147725ad25b69cbfa93f1662fd83a803d6b43add1804d48c7f0cdddb9",
        "unscale_loss_for_distribution": "3903c7ed7f69c5acb7ff4670fd5b545c664a7fa3f6510a22b2c75bac0205c90f",
        "BaseOptimizer._get_current_learning_rate": "c1f20ee84392ea42917f1de16d1ed3a2c4c70126e5c16990f8845fad8047d5f4",
        "BaseOptimizer._clip_gradients": "152b956e23c91ad9b78870b2e245dc09fe6f8f156235dadab9ffc72f07dd9b33",
        "BaseOptimizer._use_weight_decay": "0e73208c5bf5328de8e2b9166959448c8da4008d6c50da5ee6af8fadd811c508",
        "Layer._track_variable": "2f03e5ffbfe1d6629d687747549e793394d37f66a3354b49a0bfd04c66a8d680",
        "in_symbolic_scope": "d351956ebfd03055496f7d406bcf67023f96b96d70a950b9975660e99257fff7",
        "CallbackList.__init__": "d60508a5b7989a7a91fc8bb6e5df039b4eacc301dc1d7373178c92fdf867b3e5",
        "ModelCheckpoint.__init__": "0bd84765bf2adaa261c16aeb9080844804f31a12a9dcafa6b212fedb581ddc63",
        "ModelCheckpoint._save_model": "d89d3d042ffc143d6f31d22f3c91101079e5d8c30926e289933ac8b003c2d259",
        "ModelCheckpoint._get_file_path": "06ba05ff7e06b73636962afd467fcaec6cd865e5004a7264f496f1e199ca3902",
        "CSVLogger.on_train_begin": "4f842d285755017cab4a4fac0b3b9fe1d1aa31afb9ae68e12e7798689c295c3d",
        "TensorBoard.set_model": "36b4c489a66848e9735cc404790901994e4bd95dbce665b08482217304602c57",
        "BackupAndRestore.__init__": "b1387bb7d54e3d3d407c80137bfa098745faa51a047546ac1758b186f5cbab09",
        "KerasVariable.__init__": "e674350894d85176a3a20dc2e89435d151ed16a5a14fc507c2615bd1b88f0da8",
        "KerasVariable._deferred_initialize": "437c15620e8091add358f643b3b50ed4a9ea8cd194dad22704e78b6ba9b13507",
        "register_uninitialized_variable": "473e41127dcc434d06c7328c5d7d0bcece8f0cabdba055b24d34fae4bcc70736",
        "initialize_all_variables": "90281763368f6b4f90a7f960ebc810141f2bbdbc3ec1ce845e8644f8afaa9631",
        "StatelessScope.__exit__": "63ede0e0a21c1b74284151e0d9a8db293a36b60d65c97a3433a99d23c828cc0c",
        "global_state.get_global_attribute": "d39da35cc653dfaac547c8ee1667e9d9d86c9d97cc90d208ffbcc09caf970611",
        "global_state.set_global_attribute": "f31774cabee5ad63ca48848d1066bd0cbdca14c971068df298d19b601e1bfa66",
        "saving_lib._walk_saveable": "c71ae4a33956e66e58381e4f3b3cca8a5bcc041b732ce8daac6ee925be3d5190",
        "saving_lib._save_state": "eb862bca3f89a935746a95fbc77338a8868c3a93ca6c221befc7e13e1c49b334",
        "saving_lib._load_state": "1e191fbd102666549e9ce4438dac0790cc00f4e8f78158d023ecd1afceecff04",
        "saving_lib._save_container_state": "ffa18707ab6eb9e238a7f7fdbe408572eaf29377a109865fd18082c1dc0bed0b",
        "saving_lib._load_container_state": "47665768533bb81572b23c4b140a1fa0d78cfc74ca19f95407931870f7bdd819",
        "H5IOStore.make": "f83bd5e1bcc865333e9a789c8033d0b97ad7fdeec61fff993a87986ac15bfe6c",
        "H5IOStore.get": "444b04976ad04052e7deeaeccabf423030d0f7eace023015bfec5230e228814d",
        "ShardedH5IOStore.get": "52ba07676d8818aadb09999b34d84087c1ed366ea27450a3f5ec46b2695d303a",
    },
    "3.11.3": {
        "TensorFlowTrainer.make_predict_function": "5f1a30acee30e08cd41bd857387a80a8d7c05ee5d9a94095f06b0ec3978c6f49",
        "TensorFlowTrainer.predict": "ee5831d7d2179667008faeb9a0a75b1b8c4a8887174c4f8fea0c94395ee87141",
        "TensorFlowTrainer._maybe_symbolic_build": "92a504f5eba9b29f81f1bf26180bdd5bf5186b06b7bda426534b90d2d02bc1c2",
        "TensorFlowTrainer._make_function": "55eb952812cac1fbb9934e24de911532f45314c57ed6e6a53c9ebe88f392d2ff",
        "TensorFlowTrainer.train_step": "38eff65a3e8e64475bc46a4e655af968166c2909f8127cbf5d9466bdca1a0950",
        "TFOptimizer._all_reduce_sum_gradients": "dd8896fa68d7950159af19848d8b41d0c5dbd0c90ae0d82361faab0a987702ba",
        "TFOptimizer._backend_update_step": "00bd759c099a6b72e88785836a38006d3d197c329b14bf6e75b77339460d3bc3",
        "TFEpochIterator._get_iterator": "b986aa8a9d2264d9d07d284ec7cfcf2bd4ff6ebee6786029bb50a763603afd84",
        "EpochIterator._enumerate_iterator": "376e3e16a928107a7a421a25346d900d805b404430a034ddbed5c24905de9484",
        "EpochIterator.reset": "b73c9f2daadc29b45b590086d2221bbbea3a1e6345ff20956e3c022457627af0",
        "TFEpochIterator.__next__": "bbaac0291856627f210c6bd72eb09e4f910175329b6f06fc708e881f9578a9b0",
        "Trainer._symbolic_build": "9e2c2441c8d6829275d2fc040af8debfde105b5f94c00ac30e44c61e94cb7c6d",
        "Trainer._compute_loss": "13153b89c765b0d6e50e8d688cdcfa0b384c29c53b3bb576e276dff7cd71369d",
        "Trainer.get_metrics_result": "0b283618592624ffa746c2d9a2e8bff7570ee8f794979d7befc3ca47b88d46f8",
        "Trainer._get_metrics_result_or_logs": "1c7ab4a2c8e618681cbebf091de56de691c84dcec0a8e3c9842693613c548cc5",
        "reduce_per_replica": "2e7d54b1e6edc29a8c6a7e6b66cd4c8be3ba7842412c93753ac3afe169fa7fb8",
        "_multi_worker_concat": "2137073bfe27fb922127c1fe2df6048501d78cd9fef3a6c32aadfd4a71d67974",
        "reduce_values": "60b0462147725ad25b69cbfa93f1662fd83a803d6b43add1804d48c7f0cdddb9",
        "unscale_loss_for_distribution": "3903c7ed7f69c5acb7ff4670fd5b545c664a7fa3f6510a22b2c75bac0205c90f",
        "BaseOptimizer._get_current_learning_rate": "fa62361e208633409ca414faca3990910049bc954bfa25d8a97f761e7771b65e",
        "BaseOptimizer._clip_gradients": "152b956e23c91ad9b78870b2e245dc09fe6f8f156235dadab9ffc72f07dd9b33",
        "BaseOptimizer._use_weight_decay": "0e73208c5bf5328de8e2b9166959448c8da4008d6c50da5ee6af8fadd811c508",
        "Layer._track_variable": "2f03e5ffbfe1d6629d687747549e793394d37f66a3354b49a0bfd04c66a8d680",
        "in_symbolic_scope": "d351956ebfd03055496f7d406bcf67023f96b96d70a950b9975660e99257fff7",
        "CallbackList.__init__": "d60508a5b7989a7a91fc8bb6e5df039b4eacc301dc1d7373178c92fdf867b3e5",
        "ModelCheckpoint.__init__": "714ae1a794a0da77c964d6f2036c3d288152c7815a7b1a512fa443429fcf598a",
        "ModelCheckpoint._save_model": "d89d3d042ffc143d6f31d22f3c91101079e5d8c30926e289933ac8b003c2d259",
        "ModelCheckpoint._get_file_path": "06ba05ff7e06b73636962afd467fcaec6cd865e5004a7264f496f1e199ca3902",
        "CSVLogger.on_train_begin": "9e604039df27fad346c950dbcf41b818075930fadf5b5d23393fa1426f98047a",
        "TensorBoard.set_model": "36b4c489a66848e9735cc404790901994e4bd95dbce665b08482217304602c57",
        "BackupAndRestore.__init__": "b1387bb7d54e3d3d407c80137bfa098745faa51a047546ac1758b186f5cbab09",
        "KerasVariable.__init__": "e674350894d85176a3a20dc2e89435d151ed16a5a14fc507c2615bd1b88f0da8",
        "KerasVariable._deferred_initialize": "d6504e943343be80eaee871624fa52e280731b0404af8b893ef5b1980311ab4b",
        "register_uninitialized_variable": "473e41127dcc434d06c7328c5d7d0bcece8f0cabdba055b24d34fae4bcc70736",
        "initialize_all_variables": "90281763368f6b4f90a7f960ebc810141f2bbdbc3ec1ce845e8644f8afaa9631",
        "StatelessScope.__exit__": "63ede0e0a21c1b74284151e0d9a8db293a36b60d65c97a3433a99d23c828cc0c",
        "global_state.get_global_attribute": "d39da35cc653dfaac547c8ee1667e9d9d86c9d97cc90d208ffbcc09caf970611",
        "global_state.set_global_attribute": "f31774cabee5ad63ca48848d1066bd0cbdca14c971068df298d19b601e1bfa66",
        "saving_lib._walk_saveable": "c71ae4a33956e66e58381e4f3b3cca8a5bcc041b732ce8daac6ee925be3d5190",
        "saving_lib._save_state": "eb862bca3f89a935746a95fbc77338a8868c3a93ca6c221befc7e13e1c49b334",
        "saving_lib._load_state": "1e191fbd102666549e9ce4438dac0790cc00f4e8f78158d023ecd1afceecff04",
        "saving_lib._save_container_state": "ffa18707ab6eb9e238a7f7fdbe408572eaf29377a109865fd18082c1dc0bed0b",
        "saving_lib._load_container_state": "47665768533bb81572b23c4b140a1fa0d78cfc74ca19f95407931870f7bdd819",
        "H5IOStore.make": "f83bd5e1bcc865333e9a789c8033d0b97ad7fdeec61fff993a87986ac15bfe6c",
        "H5IOStore.get": "444b04976ad04052e7deeaeccabf423030d0f7eace023015bfec5230e228814d",
        "ShardedH5IOStore.make": "d7a08d66f0afe57ed12eed6149fe5d7c36e3ef9640f2161cd39e441e4d85ebc0",
        "ShardedH5IOStore.get": "6968828d83aa893d85d78d89b59c35a6dd67a02fb04cc793bcaec6e3bf7943a6",
    },
    "3.12.4": {
        "TensorFlowTrainer.make_predict_function": "a772a2efdd906f9a9ad6a19ec988d48455792fef5857a2b4ddc55b677ac350b3",
        "TensorFlowTrainer.predict": "ee5831d7d2179667008faeb9a0a75b1b8c4a8887174c4f8fea0c94395ee87141",
        "TensorFlowTrainer._maybe_symbolic_build": "92a504f5eba9b29f81f1bf26180bdd5bf5186b06b7bda426534b90d2d02bc1c2",
        "TensorFlowTrainer._make_function": "bb33b7a0da3d27406c70fac54b8e9617156ef225f452b93f6addf8cc34aca0d0",
        "TensorFlowTrainer.train_step": "debf0efab9d5794b017ade2937acbcc51886fc1dc5cf021e7d7e80f974ee707c",
        "TFOptimizer._all_reduce_sum_gradients": "dd8896fa68d7950159af19848d8b41d0c5dbd0c90ae0d82361faab0a987702ba",
        "TFOptimizer._backend_update_step": "00bd759c099a6b72e88785836a38006d3d197c329b14bf6e75b77339460d3bc3",
        "TensorFlowTrainer._autoconvert_optionals": "693fcdb15f95b31ab984981dce280656092fd7f949180533e585b1011cf061c5",
        "TFEpochIterator._get_iterator": "b986aa8a9d2264d9d07d284ec7cfcf2bd4ff6ebee6786029bb50a763603afd84",
        "EpochIterator._enumerate_iterator": "376e3e16a928107a7a421a25346d900d805b404430a034ddbed5c24905de9484",
        "EpochIterator.reset": "b73c9f2daadc29b45b590086d2221bbbea3a1e6345ff20956e3c022457627af0",
        "TFEpochIterator.__next__": "bbaac0291856627f210c6bd72eb09e4f910175329b6f06fc708e881f9578a9b0",
        "Trainer._symbolic_build": "9e2c2441c8d6829275d2fc040af8debfde105b5f94c00ac30e44c61e94cb7c6d",
        "Trainer._compute_loss": "13153b89c765b0d6e50e8d688cdcfa0b384c29c53b3bb576e276dff7cd71369d",
        "Trainer.get_metrics_result": "0b283618592624ffa746c2d9a2e8bff7570ee8f794979d7befc3ca47b88d46f8",
        "Trainer._get_metrics_result_or_logs": "1c7ab4a2c8e618681cbebf091de56de691c84dcec0a8e3c9842693613c548cc5",
        "reduce_per_replica": "2e7d54b1e6edc29a8c6a7e6b66cd4c8be3ba7842412c93753ac3afe169fa7fb8",
        "_multi_worker_concat": "2137073bfe27fb922127c1fe2df6048501d78cd9fef3a6c32aadfd4a71d67974",
        "reduce_values": "60b0462147725ad25b69cbfa93f1662fd83a803d6b43add1804d48c7f0cdddb9",
        "unscale_loss_for_distribution": "3903c7ed7f69c5acb7ff4670fd5b545c664a7fa3f6510a22b2c75bac0205c90f",
        "BaseOptimizer._get_current_learning_rate": "fa62361e208633409ca414faca3990910049bc954bfa25d8a97f761e7771b65e",
        "BaseOptimizer._clip_gradients": "152b956e23c91ad9b78870b2e245dc09fe6f8f156235dadab9ffc72f07dd9b33",
        "BaseOptimizer._use_weight_decay": "0e73208c5bf5328de8e2b9166959448c8da4008d6c50da5ee6af8fadd811c508",
        "Layer._track_variable": "2f03e5ffbfe1d6629d687747549e793394d37f66a3354b49a0bfd04c66a8d680",
        "in_symbolic_scope": "d351956ebfd03055496f7d406bcf67023f96b96d70a950b9975660e99257fff7",
        "CallbackList.__init__": "5d0d38afece9158aae5f587119fd31ec055da10b0ae49ff6804c4445630dd31e",
        "ModelCheckpoint.__init__": "714ae1a794a0da77c964d6f2036c3d288152c7815a7b1a512fa443429fcf598a",
        "ModelCheckpoint._save_model": "d89d3d042ffc143d6f31d22f3c91101079e5d8c30926e289933ac8b003c2d259",
        "ModelCheckpoint._get_file_path": "06ba05ff7e06b73636962afd467fcaec6cd865e5004a7264f496f1e199ca3902",
        "CSVLogger.on_train_begin": "9e604039df27fad346c950dbcf41b818075930fadf5b5d23393fa1426f98047a",
        "TensorBoard.set_model": "36b4c489a66848e9735cc404790901994e4bd95dbce665b08482217304602c57",
        "BackupAndRestore.__init__": "f54360566fb57a08bc28a3c1f5c546ff7240686971fd9a37ff3a5572fe2302da",
        "KerasVariable.__init__": "ec431852f460b61b6daf66c4f048ac64a233e688c14605e0b81acd5a78fc72d1",
        "KerasVariable._deferred_initialize": "d6504e943343be80eaee871624fa52e280731b0404af8b893ef5b1980311ab4b",
        "register_uninitialized_variable": "473e41127dcc434d06c7328c5d7d0bcece8f0cabdba055b24d34fae4bcc70736",
        "initialize_all_variables": "90281763368f6b4f90a7f960ebc810141f2bbdbc3ec1ce845e8644f8afaa9631",
        "StatelessScope.__exit__": "63ede0e0a21c1b74284151e0d9a8db293a36b60d65c97a3433a99d23c828cc0c",
        "global_state.get_global_attribute": "d39da35cc653dfaac547c8ee1667e9d9d86c9d97cc90d208ffbcc09caf970611",
        "global_state.set_global_attribute": "f31774cabee5ad63ca48848d1066bd0cbdca14c971068df298d19b601e1bfa66",
        "saving_lib._walk_saveable": "c71ae4a33956e66e58381e4f3b3cca8a5bcc041b732ce8daac6ee925be3d5190",
        "saving_lib._save_state": "472e9cc9267e3c4b23f189a8fc2179d3cd3d21d5270a4cce9e98415e383a2347",
        "saving_lib._load_state": "c4fd8eeccf65d665b0d4a850330d9a9a15f57e48cf848171a2a3f299223a359b",
        "saving_lib._save_container_state": "1a6e8e8c803399a5f0e67dc63ce9ab47b84725325c201288cd6a8d9240aa5229",
        "saving_lib._load_container_state": "9c3a0d26227c2cd1937711019fc196a222c0fe6c8485c0ee4f2c713eadeb1724",
        "H5IOStore.make": "f83bd5e1bcc865333e9a789c8033d0b97ad7fdeec61fff993a87986ac15bfe6c",
        "H5IOStore.get": "1dc95c2a327ae1afa250cf7567d71aeefd8b1d530f8747fca3eb74b8672161d2",
        "ShardedH5IOStore.make": "d7a08d66f0afe57ed12eed6149fe5d7c36e3ef9640f2161cd39e441e4d85ebc0",
        "ShardedH5IOStore.get": "2e2d3473149ab350d5a56a611ce3a2501642528d94e6c737bb152aafa2410da9",
    },
    "3.13.2": {
        "TensorFlowTrainer.make_predict_function": "a772a2efdd906f9a9ad6a19ec988d48455792fef5857a2b4ddc55b677ac350b3",
        "TensorFlowTrainer.predict": "ee5831d7d2179667008faeb9a0a75b1b8c4a8887174c4f8fea0c94395ee87141",
        "TensorFlowTrainer._maybe_symbolic_build": "92a504f5eba9b29f81f1bf26180bdd5bf5186b06b7bda426534b90d2d02bc1c2",
        "TensorFlowTrainer._make_function": "bb33b7a0da3d27406c70fac54b8e9617156ef225f452b93f6addf8cc34aca0d0",
        "TensorFlowTrainer.train_step": "debf0efab9d5794b017ade2937acbcc51886fc1dc5cf021e7d7e80f974ee707c",
        "TFOptimizer._all_reduce_sum_gradients": "dd8896fa68d7950159af19848d8b41d0c5dbd0c90ae0d82361faab0a987702ba",
        "TFOptimizer._backend_update_step": "00bd759c099a6b72e88785836a38006d3d197c329b14bf6e75b77339460d3bc3",
        "TensorFlowTrainer._autoconvert_optionals": "693fcdb15f95b31ab984981dce280656092fd7f949180533e585b1011cf061c5",
        "TFEpochIterator._get_iterator": "b986aa8a9d2264d9d07d284ec7cfcf2bd4ff6ebee6786029bb50a763603afd84",
        "EpochIterator._enumerate_iterator": "376e3e16a928107a7a421a25346d900d805b404430a034ddbed5c24905de9484",
        "EpochIterator.reset": "b73c9f2daadc29b45b590086d2221bbbea3a1e6345ff20956e3c022457627af0",
        "TFEpochIterator.__next__": "bbaac0291856627f210c6bd72eb09e4f910175329b6f06fc708e881f9578a9b0",
        "Trainer._symbolic_build": "9e2c2441c8d6829275d2fc040af8debfde105b5f94c00ac30e44c61e94cb7c6d",
        "Trainer._compute_loss": "13153b89c765b0d6e50e8d688cdcfa0b384c29c53b3bb576e276dff7cd71369d",
        "Trainer.get_metrics_result": "0b283618592624ffa746c2d9a2e8bff7570ee8f794979d7befc3ca47b88d46f8",
        "Trainer._get_metrics_result_or_logs": "1c7ab4a2c8e618681cbebf091de56de691c84dcec0a8e3c9842693613c548cc5",
        "reduce_per_replica": "2e7d54b1e6edc29a8c6a7e6b66cd4c8be3ba7842412c93753ac3afe169fa7fb8",
        "_multi_worker_concat": "2137073bfe27fb922127c1fe2df6048501d78cd9fef3a6c32aadfd4a71d67974",
        "reduce_values": "60b0462147725ad25b69cbfa93f1662fd83a803d6b43add1804d48c7f0cdddb9",
        "unscale_loss_for_distribution": "3903c7ed7f69c5acb7ff4670fd5b545c664a7fa3f6510a22b2c75bac0205c90f",
        "BaseOptimizer._get_current_learning_rate": "fa62361e208633409ca414faca3990910049bc954bfa25d8a97f761e7771b65e",
        "BaseOptimizer._clip_gradients": "152b956e23c91ad9b78870b2e245dc09fe6f8f156235dadab9ffc72f07dd9b33",
        "BaseOptimizer._use_weight_decay": "0e73208c5bf5328de8e2b9166959448c8da4008d6c50da5ee6af8fadd811c508",
        "Layer._track_variable": "2f03e5ffbfe1d6629d687747549e793394d37f66a3354b49a0bfd04c66a8d680",
        "in_symbolic_scope": "d351956ebfd03055496f7d406bcf67023f96b96d70a950b9975660e99257fff7",
        "CallbackList.__init__": "5d0d38afece9158aae5f587119fd31ec055da10b0ae49ff6804c4445630dd31e",
        "ModelCheckpoint.__init__": "714ae1a794a0da77c964d6f2036c3d288152c7815a7b1a512fa443429fcf598a",
        "ModelCheckpoint._save_model": "a9be0a24277ff1791394a887c166351c5d8d721c187936369b74fd84b73c3f82",
        "ModelCheckpoint._get_file_path": "06ba05ff7e06b73636962afd467fcaec6cd865e5004a7264f496f1e199ca3902",
        "CSVLogger.on_train_begin": "9e604039df27fad346c950dbcf41b818075930fadf5b5d23393fa1426f98047a",
        "TensorBoard.set_model": "36b4c489a66848e9735cc404790901994e4bd95dbce665b08482217304602c57",
        "BackupAndRestore.__init__": "f54360566fb57a08bc28a3c1f5c546ff7240686971fd9a37ff3a5572fe2302da",
        "KerasVariable.__init__": "ec431852f460b61b6daf66c4f048ac64a233e688c14605e0b81acd5a78fc72d1",
        "KerasVariable._deferred_initialize": "d6504e943343be80eaee871624fa52e280731b0404af8b893ef5b1980311ab4b",
        "register_uninitialized_variable": "473e41127dcc434d06c7328c5d7d0bcece8f0cabdba055b24d34fae4bcc70736",
        "initialize_all_variables": "90281763368f6b4f90a7f960ebc810141f2bbdbc3ec1ce845e8644f8afaa9631",
        "StatelessScope.__exit__": "63ede0e0a21c1b74284151e0d9a8db293a36b60d65c97a3433a99d23c828cc0c",
        "global_state.get_global_attribute": "d39da35cc653dfaac547c8ee1667e9d9d86c9d97cc90d208ffbcc09caf970611",
        "global_state.set_global_attribute": "f31774cabee5ad63ca48848d1066bd0cbdca14c971068df298d19b601e1bfa66",
        "saving_lib._walk_saveable": "c71ae4a33956e66e58381e4f3b3cca8a5bcc041b732ce8daac6ee925be3d5190",
        "saving_lib._save_state": "eb862bca3f89a935746a95fbc77338a8868c3a93ca6c221befc7e13e1c49b334",
        "saving_lib._load_state": "8f612ce0841e283237fd90f55b2125d83e9e4746af9bcf906b8419cb8f27fa18",
        "saving_lib._save_container_state": "ffa18707ab6eb9e238a7f7fdbe408572eaf29377a109865fd18082c1dc0bed0b",
        "saving_lib._load_container_state": "47665768533bb81572b23c4b140a1fa0d78cfc74ca19f95407931870f7bdd819",
        "H5IOStore.make": "f83bd5e1bcc865333e9a789c8033d0b97ad7fdeec61fff993a87986ac15bfe6c",
        "H5IOStore.get": "58511a51d8d0e3581d55e6bfeb60966005c64f3d04ca133f8814f15e66ccc7cb",
        "ShardedH5IOStore.make": "d7a08d66f0afe57ed12eed6149fe5d7c36e3ef9640f2161cd39e441e4d85ebc0",
        "ShardedH5IOStore.get": "1b3d7d9721224c19736415b5a46263130245e9861b596a4da7b2e139f18de767",
    },
    "3.14.1": {
        "TensorFlowTrainer.make_predict_function": "a772a2efdd906f9a9ad6a19ec988d48455792fef5857a2b4ddc55b677ac350b3",
        "TensorFlowTrainer.predict": "ee5831d7d2179667008faeb9a0a75b1b8c4a8887174c4f8fea0c94395ee87141",
        "TensorFlowTrainer._maybe_symbolic_build": "92a504f5eba9b29f81f1bf26180bdd5bf5186b06b7bda426534b90d2d02bc1c2",
        "TensorFlowTrainer._make_function": "bb33b7a0da3d27406c70fac54b8e9617156ef225f452b93f6addf8cc34aca0d0",
        "TensorFlowTrainer.train_step": "debf0efab9d5794b017ade2937acbcc51886fc1dc5cf021e7d7e80f974ee707c",
        "TFOptimizer._all_reduce_sum_gradients": "953512efa56c968002e3ddf9c13f593a893cad8770391ab6c7a1c001fde513b0",
        "TFOptimizer._backend_update_step": "00bd759c099a6b72e88785836a38006d3d197c329b14bf6e75b77339460d3bc3",
        "TensorFlowTrainer._autoconvert_optionals": "693fcdb15f95b31ab984981dce280656092fd7f949180533e585b1011cf061c5",
        "TFEpochIterator._get_iterator": "b986aa8a9d2264d9d07d284ec7cfcf2bd4ff6ebee6786029bb50a763603afd84",
        "EpochIterator._enumerate_iterator": "376e3e16a928107a7a421a25346d900d805b404430a034ddbed5c24905de9484",
        "EpochIterator.reset": "b73c9f2daadc29b45b590086d2221bbbea3a1e6345ff20956e3c022457627af0",
        "TFEpochIterator.__next__": "bbaac0291856627f210c6bd72eb09e4f910175329b6f06fc708e881f9578a9b0",
        "Trainer._symbolic_build": "96220cc3b88fe768bdafe5f6aabcf874b92940abae365f8f24e5df2a5e6ae49f",
        "Trainer._compute_loss": "13153b89c765b0d6e50e8d688cdcfa0b384c29c53b3bb576e276dff7cd71369d",
        "Trainer.get_metrics_result": "89f313bc35c1b9c1b48cfc01ed3afe11b5f83353e0d096e46ea7aaba6ff22f1d",
        "Trainer._get_metrics_result_or_logs": "1c7ab4a2c8e618681cbebf091de56de691c84dcec0a8e3c9842693613c548cc5",
        "reduce_per_replica": "2e7d54b1e6edc29a8c6a7e6b66cd4c8be3ba7842412c93753ac3afe169fa7fb8",
        "_multi_worker_concat": "2137073bfe27fb922127c1fe2df6048501d78cd9fef3a6c32aadfd4a71d67974",
        "reduce_values": "60b0462147725ad25b69cbfa93f1662fd83a803d6b43add1804d48c7f0cdddb9",
        "unscale_loss_for_distribution": "3903c7ed7f69c5acb7ff4670fd5b545c664a7fa3f6510a22b2c75bac0205c90f",
        "BaseOptimizer._get_current_learning_rate": "fa62361e208633409ca414faca3990910049bc954bfa25d8a97f761e7771b65e",
        "BaseOptimizer._clip_gradients": "152b956e23c91ad9b78870b2e245dc09fe6f8f156235dadab9ffc72f07dd9b33",
        "BaseOptimizer._use_weight_decay": "0e73208c5bf5328de8e2b9166959448c8da4008d6c50da5ee6af8fadd811c508",
        "Layer._track_variable": "2f03e5ffbfe1d6629d687747549e793394d37f66a3354b49a0bfd04c66a8d680",
        "in_symbolic_scope": "d351956ebfd03055496f7d406bcf67023f96b96d70a950b9975660e99257fff7",
        "CallbackList.__init__": "5d0d38afece9158aae5f587119fd31ec055da10b0ae49ff6804c4445630dd31e",
        "ModelCheckpoint.__init__": "15332c3008899db7542952f4bf17f3bb7cdd5f3b7d29a1a6672ee2920501d9f6",
        "ModelCheckpoint._save_model": "a9be0a24277ff1791394a887c166351c5d8d721c187936369b74fd84b73c3f82",
        "ModelCheckpoint._get_file_path": "06ba05ff7e06b73636962afd467fcaec6cd865e5004a7264f496f1e199ca3902",
        "CSVLogger.on_train_begin": "9e604039df27fad346c950dbcf41b818075930fadf5b5d23393fa1426f98047a",
        "TensorBoard.set_model": "36b4c489a66848e9735cc404790901994e4bd95dbce665b08482217304602c57",
        "BackupAndRestore.__init__": "f54360566fb57a08bc28a3c1f5c546ff7240686971fd9a37ff3a5572fe2302da",
        "KerasVariable.__init__": "ec431852f460b61b6daf66c4f048ac64a233e688c14605e0b81acd5a78fc72d1",
        "KerasVariable._deferred_initialize": "d6504e943343be80eaee871624fa52e280731b0404af8b893ef5b1980311ab4b",
        "register_uninitialized_variable": "473e41127dcc434d06c7328c5d7d0bcece8f0cabdba055b24d34fae4bcc70736",
        "initialize_all_variables": "90281763368f6b4f90a7f960ebc810141f2bbdbc3ec1ce845e8644f8afaa9631",
        "StatelessScope.__exit__": "63ede0e0a21c1b74284151e0d9a8db293a36b60d65c97a3433a99d23c828cc0c",
        "global_state.get_global_attribute": "d39da35cc653dfaac547c8ee1667e9d9d86c9d97cc90d208ffbcc09caf970611",
        "global_state.set_global_attribute": "f31774cabee5ad63ca48848d1066bd0cbdca14c971068df298d19b601e1bfa66",
        "saving_lib._walk_saveable": "c71ae4a33956e66e58381e4f3b3cca8a5bcc041b732ce8daac6ee925be3d5190",
        "saving_lib._save_state": "810b00506e339f46cccd3a0939ccca814db23fe91a66b80b38c7aeefaf9075e1",
        "saving_lib._load_state": "f9a09e8bdef97ded3812f4fd132bcd0e6b679e95b3e41a1925efb48b3c8a47fe",
        "saving_lib._save_container_state": "ffa18707ab6eb9e238a7f7fdbe408572eaf29377a109865fd18082c1dc0bed0b",
        "saving_lib._load_container_state": "47665768533bb81572b23c4b140a1fa0d78cfc74ca19f95407931870f7bdd819",
        "H5IOStore.make": "f83bd5e1bcc865333e9a789c8033d0b97ad7fdeec61fff993a87986ac15bfe6c",
        "H5IOStore.get": "1dc95c2a327ae1afa250cf7567d71aeefd8b1d530f8747fca3eb74b8672161d2",
        "ShardedH5IOStore.make": "d7a08d66f0afe57ed12eed6149fe5d7c36e3ef9640f2161cd39e441e4d85ebc0",
        "ShardedH5IOStore.get": "1b3d7d9721224c19736415b5a46263130245e9861b596a4da7b2e139f18de767",
    },
    "3.15.0": {
        "TensorFlowTrainer.make_predict_function": "a772a2efdd906f9a9ad6a19ec988d48455792fef5857a2b4ddc55b677ac350b3",
        "TensorFlowTrainer.predict": "ee5831d7d2179667008faeb9a0a75b1b8c4a8887174c4f8fea0c94395ee87141",
        "TensorFlowTrainer._maybe_symbolic_build": "92a504f5eba9b29f81f1bf26180bdd5bf5186b06b7bda426534b90d2d02bc1c2",
        "TensorFlowTrainer._make_function": "bb33b7a0da3d27406c70fac54b8e9617156ef225f452b93f6addf8cc34aca0d0",
        "TensorFlowTrainer.train_step": "debf0efab9d5794b017ade2937acbcc51886fc1dc5cf021e7d7e80f974ee707c",
        "TFOptimizer._all_reduce_sum_gradients": "953512efa56c968002e3ddf9c13f593a893cad8770391ab6c7a1c001fde513b0",
        "TFOptimizer._backend_update_step": "00bd759c099a6b72e88785836a38006d3d197c329b14bf6e75b77339460d3bc3",
        "TensorFlowTrainer._autoconvert_optionals": "693fcdb15f95b31ab984981dce280656092fd7f949180533e585b1011cf061c5",
        "TFEpochIterator._get_iterator": "b986aa8a9d2264d9d07d284ec7cfcf2bd4ff6ebee6786029bb50a763603afd84",
        "EpochIterator._enumerate_iterator": "376e3e16a928107a7a421a25346d900d805b404430a034ddbed5c24905de9484",
        "EpochIterator.reset": "b73c9f2daadc29b45b590086d2221bbbea3a1e6345ff20956e3c022457627af0",
        "TFEpochIterator.__next__": "bbaac0291856627f210c6bd72eb09e4f910175329b6f06fc708e881f9578a9b0",
        "Trainer._symbolic_build": "96220cc3b88fe768bdafe5f6aabcf874b92940abae365f8f24e5df2a5e6ae49f",
        "Trainer._compute_loss": "13153b89c765b0d6e50e8d688cdcfa0b384c29c53b3bb576e276dff7cd71369d",
        "Trainer.get_metrics_result": "89f313bc35c1b9c1b48cfc01ed3afe11b5f83353e0d096e46ea7aaba6ff22f1d",
        "Trainer._get_metrics_result_or_logs": "1c7ab4a2c8e618681cbebf091de56de691c84dcec0a8e3c9842693613c548cc5",
        "reduce_per_replica": "2e7d54b1e6edc29a8c6a7e6b66cd4c8be3ba7842412c93753ac3afe169fa7fb8",
        "_multi_worker_concat": "2137073bfe27fb922127c1fe2df6048501d78cd9fef3a6c32aadfd4a71d67974",
        "reduce_values": "60b0462147725ad25b69cbfa93f1662fd83a803d6b43add1804d48c7f0cdddb9",
        "unscale_loss_for_distribution": "3903c7ed7f69c5acb7ff4670fd5b545c664a7fa3f6510a22b2c75bac0205c90f",
        "BaseOptimizer._get_current_learning_rate": "fa62361e208633409ca414faca3990910049bc954bfa25d8a97f761e7771b65e",
        "BaseOptimizer._clip_gradients": "152b956e23c91ad9b78870b2e245dc09fe6f8f156235dadab9ffc72f07dd9b33",
        "BaseOptimizer._use_weight_decay": "0e73208c5bf5328de8e2b9166959448c8da4008d6c50da5ee6af8fadd811c508",
        "Layer._track_variable": "2f03e5ffbfe1d6629d687747549e793394d37f66a3354b49a0bfd04c66a8d680",
        "in_symbolic_scope": "d351956ebfd03055496f7d406bcf67023f96b96d70a950b9975660e99257fff7",
        "CallbackList.__init__": "5d0d38afece9158aae5f587119fd31ec055da10b0ae49ff6804c4445630dd31e",
        "ModelCheckpoint.__init__": "15332c3008899db7542952f4bf17f3bb7cdd5f3b7d29a1a6672ee2920501d9f6",
        "ModelCheckpoint._save_model": "a9be0a24277ff1791394a887c166351c5d8d721c187936369b74fd84b73c3f82",
        "ModelCheckpoint._get_file_path": "06ba05ff7e06b73636962afd467fcaec6cd865e5004a7264f496f1e199ca3902",
        "CSVLogger.on_train_begin": "9e604039df27fad346c950dbcf41b818075930fadf5b5d23393fa1426f98047a",
        "TensorBoard.set_model": "36b4c489a66848e9735cc404790901994e4bd95dbce665b08482217304602c57",
        "BackupAndRestore.__init__": "f54360566fb57a08bc28a3c1f5c546ff7240686971fd9a37ff3a5572fe2302da",
        "KerasVariable.__init__": "bee8bb8c0f2f19874bbfb4372436ec53a5c2095acc7c04ed4e5895667f7b53ab",
        "KerasVariable._deferred_initialize": "d6504e943343be80eaee871624fa52e280731b0404af8b893ef5b1980311ab4b",
        "register_uninitialized_variable": "473e41127dcc434d06c7328c5d7d0bcece8f0cabdba055b24d34fae4bcc70736",
        "initialize_all_variables": "90281763368f6b4f90a7f960ebc810141f2bbdbc3ec1ce845e8644f8afaa9631",
        "StatelessScope.__exit__": "63ede0e0a21c1b74284151e0d9a8db293a36b60d65c97a3433a99d23c828cc0c",
        "global_state.get_global_attribute": "d39da35cc653dfaac547c8ee1667e9d9d86c9d97cc90d208ffbcc09caf970611",
        "global_state.set_global_attribute": "f31774cabee5ad63ca48848d1066bd0cbdca14c971068df298d19b601e1bfa66",
        "saving_lib._walk_saveable": "c71ae4a33956e66e58381e4f3b3cca8a5bcc041b732ce8daac6ee925be3d5190",
        "saving_lib._save_state": "472e9cc9267e3c4b23f189a8fc2179d3cd3d21d5270a4cce9e98415e383a2347",
        "saving_lib._load_state": "c4fd8eeccf65d665b0d4a850330d9a9a15f57e48cf848171a2a3f299223a359b",
        "saving_lib._save_container_state": "2ef3b8c0ca3bedec291487f07c3671be6e310c006f2cfd847f20361bb990e618",
        "saving_lib._load_container_state": "d8d39c09bf555c5346739f3c4bb9029d63801f6558fb8f20cbb733ca3d466147",
        "H5IOStore.make": "f83bd5e1bcc865333e9a789c8033d0b97ad7fdeec61fff993a87986ac15bfe6c",
        "H5IOStore.get": "1dc95c2a327ae1afa250cf7567d71aeefd8b1d530f8747fca3eb74b8672161d2",
        "ShardedH5IOStore.make": "d7a08d66f0afe57ed12eed6149fe5d7c36e3ef9640f2161cd39e441e4d85ebc0",
        "ShardedH5IOStore.get": "2e2d3473149ab350d5a56a611ce3a2501642528d94e6c737bb152aafa2410da9",
    },
    "3.15.1": {
        "TensorFlowTrainer.make_predict_function": "a772a2efdd906f9a9ad6a19ec988d48455792fef5857a2b4ddc55b677ac350b3",
        "TensorFlowTrainer.predict": "ee5831d7d2179667008faeb9a0a75b1b8c4a8887174c4f8fea0c94395ee87141",
        "TensorFlowTrainer._maybe_symbolic_build": "92a504f5eba9b29f81f1bf26180bdd5bf5186b06b7bda426534b90d2d02bc1c2",
        "TensorFlowTrainer._make_function": "bb33b7a0da3d27406c70fac54b8e9617156ef225f452b93f6addf8cc34aca0d0",
        "TensorFlowTrainer.train_step": "debf0efab9d5794b017ade2937acbcc51886fc1dc5cf021e7d7e80f974ee707c",
        "TFOptimizer._all_reduce_sum_gradients": "953512efa56c968002e3ddf9c13f593a893cad8770391ab6c7a1c001fde513b0",
        "TFOptimizer._backend_update_step": "00bd759c099a6b72e88785836a38006d3d197c329b14bf6e75b77339460d3bc3",
        "TensorFlowTrainer._autoconvert_optionals": "693fcdb15f95b31ab984981dce280656092fd7f949180533e585b1011cf061c5",
        "TFEpochIterator._get_iterator": "b986aa8a9d2264d9d07d284ec7cfcf2bd4ff6ebee6786029bb50a763603afd84",
        "EpochIterator._enumerate_iterator": "376e3e16a928107a7a421a25346d900d805b404430a034ddbed5c24905de9484",
        "EpochIterator.reset": "b73c9f2daadc29b45b590086d2221bbbea3a1e6345ff20956e3c022457627af0",
        "TFEpochIterator.__next__": "bbaac0291856627f210c6bd72eb09e4f910175329b6f06fc708e881f9578a9b0",
        "Trainer._symbolic_build": "96220cc3b88fe768bdafe5f6aabcf874b92940abae365f8f24e5df2a5e6ae49f",
        "Trainer._compute_loss": "13153b89c765b0d6e50e8d688cdcfa0b384c29c53b3bb576e276dff7cd71369d",
        "Trainer.get_metrics_result": "89f313bc35c1b9c1b48cfc01ed3afe11b5f83353e0d096e46ea7aaba6ff22f1d",
        "Trainer._get_metrics_result_or_logs": "1c7ab4a2c8e618681cbebf091de56de691c84dcec0a8e3c9842693613c548cc5",
        "reduce_per_replica": "2e7d54b1e6edc29a8c6a7e6b66cd4c8be3ba7842412c93753ac3afe169fa7fb8",
        "_multi_worker_concat": "2137073bfe27fb922127c1fe2df6048501d78cd9fef3a6c32aadfd4a71d67974",
        "reduce_values": "60b0462147725ad25b69cbfa93f1662fd83a803d6b43add1804d48c7f0cdddb9",
        "unscale_loss_for_distribution": "3903c7ed7f69c5acb7ff4670fd5b545c664a7fa3f6510a22b2c75bac0205c90f",
        "BaseOptimizer._get_current_learning_rate": "fa62361e208633409ca414faca3990910049bc954bfa25d8a97f761e7771b65e",
        "BaseOptimizer._clip_gradients": "152b956e23c91ad9b78870b2e245dc09fe6f8f156235dadab9ffc72f07dd9b33",
        "BaseOptimizer._use_weight_decay": "0e73208c5bf5328de8e2b9166959448c8da4008d6c50da5ee6af8fadd811c508",
        "Layer._track_variable": "2f03e5ffbfe1d6629d687747549e793394d37f66a3354b49a0bfd04c66a8d680",
        "in_symbolic_scope": "d351956ebfd03055496f7d406bcf67023f96b96d70a950b9975660e99257fff7",
        "CallbackList.__init__": "5d0d38afece9158aae5f587119fd31ec055da10b0ae49ff6804c4445630dd31e",
        "ModelCheckpoint.__init__": "15332c3008899db7542952f4bf17f3bb7cdd5f3b7d29a1a6672ee2920501d9f6",
        "ModelCheckpoint._save_model": "a9be0a24277ff1791394a887c166351c5d8d721c187936369b74fd84b73c3f82",
        "ModelCheckpoint._get_file_path": "06ba05ff7e06b73636962afd467fcaec6cd865e5004a7264f496f1e199ca3902",
        "CSVLogger.on_train_begin": "9e604039df27fad346c950dbcf41b818075930fadf5b5d23393fa1426f98047a",
        "TensorBoard.set_model": "36b4c489a66848e9735cc404790901994e4bd95dbce665b08482217304602c57",
        "BackupAndRestore.__init__": "f54360566fb57a08bc28a3c1f5c546ff7240686971fd9a37ff3a5572fe2302da",
        "KerasVariable.__init__": "bee8bb8c0f2f19874bbfb4372436ec53a5c2095acc7c04ed4e5895667f7b53ab",
        "KerasVariable._deferred_initialize": "d6504e943343be80eaee871624fa52e280731b0404af8b893ef5b1980311ab4b",
        "register_uninitialized_variable": "473e41127dcc434d06c7328c5d7d0bcece8f0cabdba055b24d34fae4bcc70736",
        "initialize_all_variables": "90281763368f6b4f90a7f960ebc810141f2bbdbc3ec1ce845e8644f8afaa9631",
        "StatelessScope.__exit__": "63ede0e0a21c1b74284151e0d9a8db293a36b60d65c97a3433a99d23c828cc0c",
        "global_state.get_global_attribute": "d39da35cc653dfaac547c8ee1667e9d9d86c9d97cc90d208ffbcc09caf970611",
        "global_state.set_global_attribute": "f31774cabee5ad63ca48848d1066bd0cbdca14c971068df298d19b601e1bfa66",
        "saving_lib._walk_saveable": "c71ae4a33956e66e58381e4f3b3cca8a5bcc041b732ce8daac6ee925be3d5190",
        "saving_lib._save_state": "472e9cc9267e3c4b23f189a8fc2179d3cd3d21d5270a4cce9e98415e383a2347",
        "saving_lib._load_state": "6dcef2082c1d2c75e2ee8da8b5b9d087f18fa0062fc75271b3f2c72d42d51af5",
        "saving_lib._save_container_state": "2ef3b8c0ca3bedec291487f07c3671be6e310c006f2cfd847f20361bb990e618",
        "saving_lib._load_container_state": "0eba305c852b5dd831b5d5573a67c8291a7ec468cb25dcc567f46be702b87368",
        "H5IOStore.make": "f83bd5e1bcc865333e9a789c8033d0b97ad7fdeec61fff993a87986ac15bfe6c",
        "H5IOStore.get": "1dc95c2a327ae1afa250cf7567d71aeefd8b1d530f8747fca3eb74b8672161d2",
        "ShardedH5IOStore.make": "d7a08d66f0afe57ed12eed6149fe5d7c36e3ef9640f2161cd39e441e4d85ebc0",
        "ShardedH5IOStore.get": "2e2d3473149ab350d5a56a611ce3a2501642528d94e6c737bb152aafa2410da9",
        "TFVariable._initialize_with_initializer": "14c5c207bc313aecf483f8c2f4cbb93eb9daf10afcfd05cba02d7e91ad7989c1",
        "TFVariable._initialize": "ab759c22f87fb300c93b8283ea280ff99a52fc483376bd43d1edc26b0080601d",
        "TFVariable.__tf_tensor__": "9a26cf5a543d6b496d8b6432905924cc9e2470c2ba84cefd22381c1c4bb0466c",
        "KerasVariable.value": "0f5246d03308a8f39cb7fb92e5d596c77371f75ab0cf9fbf0c5a2b5b6c07b1a9",
        "KerasVariable.assign": "4fdea6a6244132ab5b3c8f7b7da108258ea9e8dd457c92be70c8a8e5122a44a3",
        "KerasVariable._maybe_autocast": "1b42c967de4732d633756fbf33dbd29283a5d6024964ea079412a65f4fe627ab",
        "BaseOptimizer.add_variable_from_reference": "00c77a731b5a12c96ba3e7b8bac5bc1c103ef4f59c879196320af8da4681966f",
        "Layer.__call__": "4fb7e42e4ffd9b1ab8d23006c049981364609973d18a066a27547c29c1c31754",
        "StatelessScope.get_current_value": "10bed40ffeae5fca2c5b1a80c290f9cd8871d3e2053d4606c7ecd4fbf7d3cb74",
        "Dense.call": "50d7f2ec4bcf91d03dab1762f182081e9cce95289e086444c3177d142692a50b",
        "EinsumDense.call": "11e1183ef9c2b8e574d47fe58a8f7315b06de34c5e1a6588ae6936f8a7529b64",
        "Embedding.call": "2fe5e1e7474fd6709869bc3ff4326ba70c9a5e0aac30ac2d14623cf8463b3e4c",
        "Dense.kernel": "62ffa16ca549786e5fb2343726b3c8c8f73cfe4fae5b638ded84755fbf133eda",
        "EinsumDense.kernel": "29801be8eb865a3b603c57027eae44fc0f4ab13c51686f41865b12feb7b1e5c8",
        "Embedding.embeddings": "6eb00a148e784953bab7ed13cdc950499f15480ae22d4b46bec7934552b71ed1",
    },
    # keras-nightly (the 3.16 pre-release): the changes and how each is
    # handled are in docs/troubleshooting.md ("Keras 3.16").
    "3.16.0.dev2026102704": {
        "TensorFlowTrainer._maybe_symbolic_build": "92a504f5eba9b29f81f1bf26180bdd5bf5186b06b7bda426534b90d2d02bc1c2",
        "TensorFlowTrainer._make_function": "b96ff481cdc14b4cad4a0fe00d41b6c6c908f4e173bfcca153815fd06533d298",
        "TensorFlowTrainer.train_step": "debf0efab9d5794b017ade2937acbcc51886fc1dc5cf021e7d7e80f974ee707c",
        "TensorFlowTrainer.make_predict_function": "3b96b2b92cd675c61c01d2a4e0b2b906d385982ede7defed909deceb4f407e7c",
        "TFOptimizer._all_reduce_sum_gradients": "953512efa56c968002e3ddf9c13f593a893cad8770391ab6c7a1c001fde513b0",
        "TFOptimizer._backend_update_step": "00bd759c099a6b72e88785836a38006d3d197c329b14bf6e75b77339460d3bc3",
        "TensorFlowTrainer._autoconvert_optionals": "693fcdb15f95b31ab984981dce280656092fd7f949180533e585b1011cf061c5",
        "TFEpochIterator._get_iterator": "b986aa8a9d2264d9d07d284ec7cfcf2bd4ff6ebee6786029bb50a763603afd84",
        "EpochIterator._enumerate_iterator": "376e3e16a928107a7a421a25346d900d805b404430a034ddbed5c24905de9484",
        "EpochIterator.reset": "b73c9f2daadc29b45b590086d2221bbbea3a1e6345ff20956e3c022457627af0",
        "TFEpochIterator.__next__": "bbaac0291856627f210c6bd72eb09e4f910175329b6f06fc708e881f9578a9b0",
        "TensorFlowTrainer.predict": "ee5831d7d2179667008faeb9a0a75b1b8c4a8887174c4f8fea0c94395ee87141",
        "Trainer._symbolic_build": "52eebdd95b04c3fd3d623f0a102cf54db4bb83a8c77b51a0b8f83fafe3cc2110",
        "Trainer._compute_loss": "13153b89c765b0d6e50e8d688cdcfa0b384c29c53b3bb576e276dff7cd71369d",
        "Trainer.get_metrics_result": "89f313bc35c1b9c1b48cfc01ed3afe11b5f83353e0d096e46ea7aaba6ff22f1d",
        "Trainer._get_metrics_result_or_logs": "1c7ab4a2c8e618681cbebf091de56de691c84dcec0a8e3c9842693613c548cc5",
        "reduce_per_replica": "2e7d54b1e6edc29a8c6a7e6b66cd4c8be3ba7842412c93753ac3afe169fa7fb8",
        "_multi_worker_concat": "2137073bfe27fb922127c1fe2df6048501d78cd9fef3a6c32aadfd4a71d67974",
        "reduce_values": "60b0462147725ad25b69cbfa93f1662fd83a803d6b43add1804d48c7f0cdddb9",
        "unscale_loss_for_distribution": "3903c7ed7f69c5acb7ff4670fd5b545c664a7fa3f6510a22b2c75bac0205c90f",
        "BaseOptimizer._get_current_learning_rate": "fa62361e208633409ca414faca3990910049bc954bfa25d8a97f761e7771b65e",
        "BaseOptimizer._clip_gradients": "09c1f7e0bfe4e0ee633379cecedc05ccfd339f9cd1e261c2a1c5ead094fa2904",
        "BaseOptimizer._use_weight_decay": "72d274cad04e3accf6afc4b63539438b86a8f570b35d2bc7b5fde32047fccc50",
        "Layer._track_variable": "2f03e5ffbfe1d6629d687747549e793394d37f66a3354b49a0bfd04c66a8d680",
        "in_symbolic_scope": "d351956ebfd03055496f7d406bcf67023f96b96d70a950b9975660e99257fff7",
        "CallbackList.__init__": "5d0d38afece9158aae5f587119fd31ec055da10b0ae49ff6804c4445630dd31e",
        "ModelCheckpoint.__init__": "15332c3008899db7542952f4bf17f3bb7cdd5f3b7d29a1a6672ee2920501d9f6",
        "ModelCheckpoint._save_model": "a9be0a24277ff1791394a887c166351c5d8d721c187936369b74fd84b73c3f82",
        "ModelCheckpoint._get_file_path": "06ba05ff7e06b73636962afd467fcaec6cd865e5004a7264f496f1e199ca3902",
        "CSVLogger.on_train_begin": "9e604039df27fad346c950dbcf41b818075930fadf5b5d23393fa1426f98047a",
        "TensorBoard.set_model": "36b4c489a66848e9735cc404790901994e4bd95dbce665b08482217304602c57",
        "BackupAndRestore.__init__": "f54360566fb57a08bc28a3c1f5c546ff7240686971fd9a37ff3a5572fe2302da",
        "KerasVariable.__init__": "bee8bb8c0f2f19874bbfb4372436ec53a5c2095acc7c04ed4e5895667f7b53ab",
        "KerasVariable._deferred_initialize": "d6504e943343be80eaee871624fa52e280731b0404af8b893ef5b1980311ab4b",
        "register_uninitialized_variable": "473e41127dcc434d06c7328c5d7d0bcece8f0cabdba055b24d34fae4bcc70736",
        "initialize_all_variables": "90281763368f6b4f90a7f960ebc810141f2bbdbc3ec1ce845e8644f8afaa9631",
        "StatelessScope.__exit__": "63ede0e0a21c1b74284151e0d9a8db293a36b60d65c97a3433a99d23c828cc0c",
        "global_state.get_global_attribute": "d39da35cc653dfaac547c8ee1667e9d9d86c9d97cc90d208ffbcc09caf970611",
        "global_state.set_global_attribute": "f31774cabee5ad63ca48848d1066bd0cbdca14c971068df298d19b601e1bfa66",
        "saving_lib._walk_saveable": "c71ae4a33956e66e58381e4f3b3cca8a5bcc041b732ce8daac6ee925be3d5190",
        "saving_lib._save_state": "f2d87e3cea66a99325e8d3caf8d67c29611e8bd60a02c6949ab691376bdcb60a",
        "saving_lib._load_state": "d789aa47c713bf86401467e89701fa947c7c040a4ce169dfc19e2a88a7e8e8ec",
        "saving_lib._save_container_state": "2ef3b8c0ca3bedec291487f07c3671be6e310c006f2cfd847f20361bb990e618",
        "saving_lib._load_container_state": "0eba305c852b5dd831b5d5573a67c8291a7ec468cb25dcc567f46be702b87368",
        "H5IOStore.make": "f83bd5e1bcc865333e9a789c8033d0b97ad7fdeec61fff993a87986ac15bfe6c",
        "H5IOStore.get": "1dc95c2a327ae1afa250cf7567d71aeefd8b1d530f8747fca3eb74b8672161d2",
        "ShardedH5IOStore.make": "d7a08d66f0afe57ed12eed6149fe5d7c36e3ef9640f2161cd39e441e4d85ebc0",
        "ShardedH5IOStore.get": "2e2d3473149ab350d5a56a611ce3a2501642528d94e6c737bb152aafa2410da9",
    },
}

_TENSORFLOW_SHA256 = {
    "2.21.0": {
        "collective_ops.all_reduce_v2": "8f204ea12fae794f1699f6b320700dbcbd9986f7aff55e9fc22b17ddb9314156",
        "collective_ops.all_gather_v2": "19aef99a43c2a1071251c147c00a11d36cde58a3ceb4c08ac52a77573818f513",
        "collective_ops.all_to_all_v2": "41986480d4a582e3bf8347e6d63f9e3ff643b607589203c67a385733bad0cb65",
        "collective_ops.broadcast_send_v2": "828c833955a182cbd2eae203f021c5f2040f37111bb8bf32f0c203c428edda71",
        "collective_ops.broadcast_recv_v2": "2c91b2ce671f2dbe66744e6105ee0ca04e9564c73049b7bda93ac0d04a703d2b",
        "gen_collective_ops.collective_reduce_scatter_v2": "ec8047c71b9d0c1fc20942c44f602f401d0aa2b2f0251bdfc0f891e4d84b8732",
        "Context.abort_collective_ops": "fb51ede659d90961b33badb53c77c83985288f0d81301eba09e1e344eeb7abab",
        "Context.coordination_service": "1e58d4c77c6099ef224a10519c0bf472d588b7a0180e2f4c34a89902ce290b5e",
        "Context.set_config_key_value": "b3c27a62ad85bd2012e45785ff505244a6e198b6d2fb036c93f33d72808f4604",
        "Context.get_config_key_value": "4d8db85cf91ec3ef07b37cd42f97d8d3532730d6fbd31560450f40cd0932f8e7",
        "FuncGraph.capture": "99fec5a8f28b4489a96ea0571abb9e52d3da39ca7eda86a799cf4c8f4332c439",
        "FuncGraph.capture_call_time_value": "ac7e0bf8a0980800d6084f8c4cea4dfe30f0c1bd815873787bce6e98002762fb",
        "Operation._update_input": "838669f6808a807be590449f94f8cfd423e36ec19f104c5b2ee22be7e063de4f",
        "record.stop_recording": "3ed89958f959dd5436ba0fa70f3fd0fb711614327a1c35c35853fc85b5da7d98",
        "device_util.current": "b1bd8cf210842672c39088cdd62157c8ba1cf4099d39e789793c15582d0ae33a",
        "device_util.canonicalize": "0524e7daa5230886d26ff49d09aab696c680fd6162844de070df72fdebd32230",
        "DistributedVariable._get_on_device_or_primary": "42bac83f6c128dcece08fbd0fbe640bc5c8ccbc01c14084e5059e36cc4452195",
        "PerReplica": "53cab5d218a50ed9920f6cb5871c5ca59e3a20ceee1791861a0e5fd76a72694b",
        "distribute_lib.get_update_replica_id": "ea691a81b9e808144acfcc22646a1181632397d387786a99c6294662c44f8547",
        "conversion.is_allowlisted": "2a6f6ed3185b047a20a369d5299043e959076da9ded245bb833a8feb086144be",
    },
}


def _sha256(fn):
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()


def _check(recorded_by_version, version, functions, boundary):
    current = {name: _sha256(fn) for name, fn in functions.items()}
    recorded = recorded_by_version.get(version)
    if recorded is None:
        pytest.fail(
            f"keras_comm has not been checked against version {version}. Review "
            f"the functions below against {boundary}, then record in {__file__}:\n"
            + json.dumps({version: current}, indent=4)
        )
    missing = sorted(set(current) - set(recorded))
    changed = sorted(n for n in current if n in recorded and current[n] != recorded[n])
    assert not missing and not changed, (
        f"Version {version}: private code keras_comm relies on changed: {changed}; "
        f"not yet recorded: {missing}. Port the change into {boundary} (and the "
        "code relying on it), then update the recorded hashes:\n"
        + json.dumps({n: current[n] for n in changed + missing}, indent=4)
    )


def test_keras_private_functions_unchanged():
    _check(_KERAS_SHA256, keras.version(), keras_api.relied_on(), "keras_comm/_private/keras_api.py")


def test_tensorflow_private_functions_unchanged():
    _check(
        _TENSORFLOW_SHA256, tf.__version__, tf_api.relied_on(), "keras_comm/_private/tf_api.py"
    )


def test_every_supported_keras_version_is_recorded():
    low, high = keras_comm.compat.SUPPORTED_KERAS
    minors = {tuple(int(p) for p in v.split(".")[:2]) for v in _KERAS_SHA256}
    wanted = {(low[0], m) for m in range(low[1], high[1])}
    assert wanted <= minors, f"no hashes for Keras {sorted(wanted - minors)}"


def test_private_keras_attributes_exist():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    assert keras_api.call_has_training_arg(model) in (True, False)
    assert keras_api.model_strategy(model) is None  # no strategy at compile
    assert isinstance(keras_api.tf_variable(model.weights[0]), tf.Variable)
    assert keras_api.learning_rate_variable(model.optimizer) is not None
    model.fit(tf.zeros([4, 3]), tf.zeros([4, 2]), verbose=0)
    assert model._loss_tracker.result() is not None  # what track_loss updates
    keras_api.set_initial_epoch(model, None)  # fit reads it back: must exist
    assert "_initial_epoch" in vars(model)
    assert float(keras_api.current_learning_rate(model.optimizer)) == pytest.approx(0.1)
    with keras.StatelessScope(initialize_variables=False):
        deferred = keras.layers.Dense(2)
        deferred.build((None, 3))
    assert callable(keras_api.deferred_initializer(deferred.kernel))
    assert keras_api.is_uninitialized(deferred.kernel)  # reads `_value`
    assert not keras_api.is_uninitialized(model.weights[0])
    # What fully_shard's in-place sharding reads (keras_api.own_weights,
    # sublayers, deferred_variables, replace_layers, share_nodes).
    dense = model.layers[0]
    assert keras_api.own_weights(dense) == list(dense.weights)
    assert dense in keras_api.sublayers(model)
    assert keras_api.optimizer_references(model.optimizer) == list(model.trainable_variables)
    assert hasattr(keras.Variable, "_initialize_with_initializer")
    # What split compute reads (keras_api.plain_kernel): the variables behind
    # the kernel properties, and the hook in place of Keras's calls.
    assert keras_api.plain_kernel(dense, "dense") is dense.kernel
    embedding = keras.layers.Embedding(5, 2)
    embedding.build((None,))
    assert keras_api.plain_kernel(embedding, "embedding") is embedding.embeddings
    einsum = keras.layers.EinsumDense("ab,bc->ac", 2)
    einsum.build((None, 3))
    assert keras_api.plain_kernel(einsum, "einsum_dense") is einsum.kernel
    for kind, cls in (("dense", keras.layers.Dense), ("embedding", keras.layers.Embedding)):
        assert cls.call.__wrapped__ is keras_api.upstream_layer_call(kind)
    functional = keras.Model(model.inputs, model.outputs)
    for name in ("_operations", "_operations_by_depth", "_nodes_by_depth"):
        assert hasattr(functional, name), name
    assert dense._inbound_nodes and hasattr(dense, "_outbound_nodes")


def test_keep_uninitialized_empties_the_queue():
    # What FullyShard relies on: variables created in a StatelessScope are
    # queued in global_state's "uninitialized_variables" and allocated by the
    # next outermost scope that initialises; keep_uninitialized takes them out.
    with keras.StatelessScope(initialize_variables=False):
        layer = keras.layers.Dense(2)
        layer.build((None, 3))
    keras_api.keep_uninitialized(layer.variables)
    with keras.StatelessScope():
        pass
    assert all(keras_api.is_uninitialized(v) for v in layer.variables)
    with keras.StatelessScope(initialize_variables=False):
        queued = keras.layers.Dense(2)
        queued.build((None, 3))
    with keras.StatelessScope():
        pass  # the control: without keep_uninitialized they are allocated
    assert not any(keras_api.is_uninitialized(v) for v in queued.variables)


def test_private_saving_helpers(tmp_path):
    # weights_store_path reads the H5 store's `_h5_entry_path` (set by
    # make/get); save_children/load_children call saving_lib's walkers.
    from keras_comm._private.keras_api import _saving_lib

    lib = _saving_lib()
    inner = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    path = tmp_path / "w.weights.h5"
    store = lib.H5IOStore(path, mode="w")
    try:
        assert keras_api.weights_store_path(store.make("outer/inner")) == "outer/inner"
        keras_api.save_children(inner, store, "outer/inner")
    finally:
        store.close()
    other = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    store = lib.H5IOStore(path, mode="r")
    try:
        assert keras_api.weights_store_path(store.get("outer/inner")) == "outer/inner"
        keras_api.load_children(other, store, "outer/inner")
    finally:
        store.close()
    for a, b in zip(inner.get_weights(), other.get_weights()):
        assert (a == b).all()
    with pytest.raises(TypeError, match="H5 weights store"):
        keras_api.weights_store_path(object())
    # A mismatch is raised, not recorded and dropped.
    wrong = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    store = lib.H5IOStore(path, mode="r")
    try:
        with pytest.raises(ValueError):
            keras_api.load_children(wrong, store, "outer/inner")
    finally:
        store.close()


def test_private_tensorflow_attributes_exist():
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    assert tf_api.communication_implementation(strategy) in ("auto", "ring", "nccl")
    assert strategy.extended._communication_options is not None  # what it reads

    def replica():
        return tf_api.replica_id(tf.distribute.get_replica_context())

    ids = strategy.experimental_local_results(strategy.run(replica))
    assert [int(i) for i in ids] == list(range(strategy.num_replicas_in_sync))
    with strategy.scope():
        variable = tf.Variable(1.0)
    assert tf_api.local_component(variable) is not variable


# Private names only the boundary modules may use: imports, and the private
# attributes the boundary reads (each behind a named function there).
_PRIVATE_ATTRS = (
    "_value", "_id", "_update_input", "_replica_id_in_sync_group",
    "_communication_options", "_get_on_device_or_primary", "_track_variable",
    "_initial_epoch", "_compute_loss", "_loss_tracker", "_call_has_training_arg",
    "_make_function", "_maybe_symbolic_build", "_get_current_learning_rate",
    "_clip_gradients", "_use_weight_decay", "_learning_rate", "_distribute_strategy",
    "_symbolic_build", "_value_specs", "_get_iterator", "_all_reduce_sum_gradients",
    "_autoconvert_optionals", "_initializer", "_h5_entry_path", "_walk_saveable",
    "_save_state", "_load_state", "_save_container_state", "_load_container_state",
    "_enumerate_iterator", "_current_iterator", "_steps_seen", "_num_batches",
    "_trainable_variables", "_non_trainable_variables", "_flatten_layers",
    "_initialize_with_initializer", "_deferred_initialize", "_operations_by_depth",
    "_nodes_by_depth", "_inbound_nodes", "_outbound_nodes",
)
_PRIVATE_CODE = re.compile(
    r"keras \. src|tensorflow \. python|\. (" + "|".join(_PRIVATE_ATTRS) + r")\b"
)


def _private_uses(path):
    """(line, text) of private accesses in code (not docstrings or comments)."""
    found = []
    with open(path, "rb") as f:
        tokens = list(tokenize.tokenize(f.readline))
    lines = pathlib.Path(path).read_text().splitlines()
    code_lines = {}
    for tok in tokens:
        if tok.type == tokenize.STRING:
            # getattr(obj, "_private_name") counts; prose does not.
            reflective = re.search(r"\b(get|set|has)attr\(", tok.line)
            if reflective and tok.string.strip("\"'") in _PRIVATE_ATTRS:
                found.append((tok.start[0], tok.line.strip()))
        elif tok.type not in (tokenize.COMMENT, tokenize.ENCODING):
            code_lines.setdefault(tok.start[0], []).append(tok.string)
    for number, parts in code_lines.items():
        text = " ".join(parts)
        if _PRIVATE_CODE.search(text):
            found.append((number, lines[number - 1].strip()))
    return sorted(found)


def test_only_the_boundary_modules_touch_private_apis():
    package = pathlib.Path(keras_comm.__file__).parent
    offenders = []
    for path in sorted(package.rglob("*.py")):
        if path.parent.name == "_private":
            continue
        for number, text in _private_uses(path):
            offenders.append(f"{path.relative_to(package.parent)}:{number}: {text}")
    assert not offenders, (
        "Private Keras/TensorFlow access outside keras_comm/_private (add a named "
        "function to keras_api.py or tf_api.py and call it):\n" + "\n".join(offenders)
    )


def test_the_boundary_check_sees_private_access(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        '"""Mentions model._loss_tracker in prose only."""\n'
        "from tensorflow.python.ops import collective_ops\n"
        "x = model._loss_tracker  # a comment about ._value\n"
        'y = getattr(v, "_distribute_strategy", None)\n'
    )
    assert [n for n, _ in _private_uses(sample)] == [2, 3, 4]


@pytest.mark.inprocess
def test_one_symbolic_build_detector_for_ops_and_parallel_layers():
    """`keras_api.in_symbolic_build` is True only while Keras traces layers on
    placeholders outside any replica; the collectives and the parallel layers
    share it. Cross-replica context outside Keras's symbolic scope is not a
    symbolic build: a parallel layer called there raises instead of returning
    its shape stand-in (values computed from rank 0's shard alone)."""
    from conftest import make_strategy
    from conftest import run_replicas
    from keras_comm.ops import _collective
    from keras_comm.parallel import ColumnParallelDense
    from keras_comm.parallel import _common

    assert _common.shape_only is keras_api.in_symbolic_build
    assert "_in_keras_symbolic_build" not in vars(_collective)
    strategy = make_strategy(2)
    seen = []

    class Probe(keras.layers.Layer):
        def call(self, x):
            seen.append(keras_api.in_symbolic_build())
            return x

    probe = Probe()
    with strategy.scope():
        keras.Sequential([keras.Input((3,)), probe])  # traced on placeholders
        assert not keras_api.in_symbolic_build()  # cross-replica, no symbolic scope
    assert seen == [True]
    keras.Sequential([keras.Input((3,)), Probe()])  # no strategy: one replica
    assert seen == [True, False]
    run_replicas(strategy, lambda: probe(tf.ones([1, 3])))  # replica context
    assert seen == [True, False, False, False]

    with strategy.scope():
        layer = ColumnParallelDense(4)
        model = keras.Sequential([keras.Input((3,)), layer])  # stand-ins: builds
        with pytest.raises(RuntimeError, match="cross-replica context"):
            model(tf.ones([2, 3]))
