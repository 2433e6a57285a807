"""keras.distribution on TensorFlow across real worker processes
(tests/parallel/distribution_worker.py).

One launch of 2 workers: KerasHub's Llama and Gemma built under their own
`get_layout_map` on a (1, 2) mesh, and GPT-2 under `DataParallel`; each is
trained on global batches and compared with the same model trained in each
worker's process alone, then `generate()` runs (inside
`keras_comm.distribution.gathered`) and `.weights.h5` files go from the split
model to the plain one and back.
"""

import pytest

import distribution_worker as W
from _cluster import run_cluster

RTOL = 1e-5


@pytest.mark.multiprocess
def test_kerashub_models_under_keras_distribution_across_processes(tmp_path):
    result = run_cluster("parallel/distribution_worker.py", 2, tmp_path, timeout=900).check()
    for rank, r in enumerate(result.results):
        print(rank, r)
        for case, out in r.items():
            for key in ("initial", "loss", "weights", "predict", "saved_to_plain", "plain_to_split"):
                assert out[key] <= RTOL, (rank, case, key, out)
            assert out["generate_equal"], (rank, case, out)
            if case.endswith("-model"):
                assert out["split"] >= 10 and out["blocks_stored"], (rank, case, out)
                assert out["slots_split"] == 2 * out["split"], (rank, case, out)
                assert out["stored_fraction"] < 0.7, (rank, case, out)
                # Split compute: no kernel is all-gathered whole in a step.
                expected = W.EXPECTED_WHOLE[case.split("-")[0]]
                assert out["gathered_whole"] == expected, (rank, case, out)
            else:
                assert out["split"] == 0, (rank, case, out)
