"""`python -m keras_comm_run`: the same as `keras-comm-run`."""

import sys

from keras_comm_run.cli import main

sys.exit(main())
