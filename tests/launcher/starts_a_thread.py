"""A module that starts a thread on import: `--preload` must refuse it."""

import threading

_stop = threading.Event()
threading.Thread(target=_stop.wait, name="started on import", daemon=True).start()
