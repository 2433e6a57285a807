"""keras.distribution on TensorFlow across real worker processes
(tests/parallel/distribution_worker.py).

Two launches of 2 workers. The first: KerasHub's Llama and Gemma built
under their own `get_layout_map` on a (1, 2) mesh, and GPT-2 under
`DataParallel`; each is trained on global batches and compared with the
same model trained alone (once, in the test's process), then `generate()` runs
(inside `keras_comm.distribution.gathered`) and `.weights.h5` files go from
the split model to the plain one and back; Llama's and Gemma's then train
the last of the resume's 3 batches, which makes them its uninterrupted runs.
It then trains GPT-2 (`fully_shard`) uninterrupted, and each of the three
again, stopped after a `BackupAndRestore` backup. The second launch (fresh processes)
resumes each from its backup and must end where the uninterrupted run did.

On 4 workers (a group of the shared launch, tests/parallel/pipeline_worker.py),
in float64: Llama under its layout map on a (2, 2) mesh and GPT-2 fully
sharded, each stopped, resumed by a model built anew, and compared with the
unsplit model trained in one process; the resumed model's file loads into
the unsplit model here.
"""

import numpy as np
import pytest

import distribution_worker as W
from _cluster import run_cluster
from _cluster import shared_cluster
from fully_shard_worker import rel

# A resume in a fresh launch against the same launch size's uninterrupted
# run: the same computation, so equal to float32 round-off of the file's
# round trip (none: files hold the values bit for bit).
RESUME_RTOL = 1e-6  # measured: 0.0 (bit for bit)


@pytest.mark.multiprocess
def test_kerashub_models_under_keras_distribution_across_processes(tmp_path, tmp_path_factory):
    import fully_shard_kerashub_worker as hub

    # The models trained alone: once, here (shared with the fully-sharded
    # KerasHub tests of this pytest run: the same models, data and Adam),
    # not in every worker.
    refs = hub.reference_dir(tmp_path_factory)
    for name in ("llama", "gemma", "gpt2"):
        hub.reference(name, "adam", 2, refs)
    result = run_cluster("parallel/distribution_worker.py", 2, tmp_path, refs, timeout=900).check()
    print("group seconds:", [r["group_seconds"] for r in result.results])
    print("group CPU seconds:", [r["group_cpu_seconds"] for r in result.results])
    for rank, r in enumerate(result.results):
        r = dict(r)
        r.pop("group_seconds")
        r.pop("group_cpu_seconds")
        uninterrupted = r.pop("uninterrupted")
        assert set(uninterrupted) == set(W.RESUME_CASES), uninterrupted.keys()
        print(rank, r)
        for case, out in r.items():
            for key in ("initial", "loss", "weights", "predict", "saved_to_plain", "plain_to_split"):
                assert out[key] <= W.bound(key), (rank, case, key, out)
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

    # Fresh processes resume every case from the first launch's backups.
    resumed = run_cluster("parallel/distribution_worker.py", 2, tmp_path, "resume", timeout=600).check()
    print("resume group seconds:", [r["group_seconds"] for r in resumed.results])
    print("resume group CPU seconds:", [r["group_cpu_seconds"] for r in resumed.results])
    for rank, (first, second) in enumerate(zip(result.results, resumed.results, strict=True)):
        for case in W.RESUME_CASES:
            got = rel(first["uninterrupted"][case], second["resumed"][case])
            print("resume", rank, case, got)
            assert got <= RESUME_RTOL, (rank, case, got)


@pytest.mark.multiprocess
def test_kerashub_float64_resume_on_four_workers():
    launch = shared_cluster("parallel/pipeline_worker.py", 4, timeout=1200).check()
    results = [r["kerashub"] for r in launch.results]
    print("kerashub group seconds:", [r["group_seconds"].get("kerashub") for r in launch.results])
    print("launch group CPU seconds:", [r["group_cpu_seconds"] for r in launch.results])
    chief = results[0]
    for case, (name, mode, _) in W.FOUR_WORKER_CASES.items():
        want = chief[case]["one_process"]
        for rank, r in enumerate(results):
            out = r[case]
            got = rel(want, out["weights"])
            print(case, rank, got, out["seconds"], "s")
            assert out["dtypes"] == ["float64"], (rank, case, out["dtypes"])
            assert got <= W.FLOAT64_RTOL[name], (rank, case, got)
            if mode == "model":
                assert out["split"] >= 10, (rank, case, out["split"])
        # The chief's file of the resumed model loads into the unsplit model, in one process.
        with W.float64():
            plain = W.MODELS[name](seed=3)
            plain.load_weights(str(launch.out_dir / f"{case}.weights.h5"))
            loaded = plain.get_weights()
        assert all(np.asarray(w).dtype == np.float64 for w in loaded), case
        assert rel(chief[case]["weights"], loaded) == 0.0, case
