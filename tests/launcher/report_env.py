"""Worker: reports its environment and argv; writes to stdout and stderr."""

import os
import sys

from _cluster import rank, write_result

print(f"stdout line from rank {rank()}")
print(f"stderr line from rank {rank()}", file=sys.stderr)
write_result(
    {
        "pid": os.getpid(),
        "argv": sys.argv[1:],
        "tf_config": os.environ.get("TF_CONFIG"),
        "rank": os.environ.get("KERAS_COMM_RANK"),
        "world_size": os.environ.get("KERAS_COMM_WORLD_SIZE"),
        "extra": os.environ.get("KERAS_COMM_TEST_EXTRA"),
        **{
            name: os.environ.get(name)
            for name in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "KERAS_COMM_LOCAL_RANK",
                "KERAS_COMM_LOCAL_WORLD_SIZE", "KERAS_COMM_NODE_RANK",
                "KERAS_COMM_RESTART_ATTEMPT", "CUDA_VISIBLE_DEVICES", "TF_NUM_INTRAOP_THREADS",
            )
        },
    }
)
# A final line without a newline must still reach the launcher's output.
sys.stdout.write(f"partial line from rank {rank()}")
