"""Test-only: huggingface_hub's download retries without their one-second waits.

tests/test_download.py's resume tests drop a connection more often than huggingface_hub
retries it (file_download.http_get: five retries, each after time.sleep(1)), so that the run
stops and leaves a partial file. With this directory on the `specli download` process's
PYTHONPATH, those retries still happen, one after another: five seconds less a test, in which
its xdist worker's CPU had nothing to do.
"""

import time
import types

from huggingface_hub import file_download

file_download.time = types.SimpleNamespace(
    **{name: getattr(time, name) for name in dir(time) if not name.startswith("_")})
file_download.time.sleep = lambda seconds: None
