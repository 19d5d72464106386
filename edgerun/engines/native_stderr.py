"""What a C++ runtime prints on file descriptor 2 while it loads a model, moved into Python logging.

LiteRT (and tflite-runtime) print "INFO: Created TensorFlow Lite XNNPACK delegate for CPU." with fprintf to
stderr on every model load. The library's own switch (``tflite::LoggerOptions::SetMinimumLogSeverity``) is a
C++ API that neither Python package binds or exports, and no environment variable reaches it
(``TF_CPP_MIN_LOG_LEVEL`` is absl's, not this logger's). So, only around the load, descriptor 2 goes to a
temporary file; afterwards each line is logged: the runtime's INFO lines at debug (``-vv`` shows them),
anything else at warning, so an error the runtime prints is still seen, through the journal like the rest.

Descriptor 2 is the process's: what another thread writes to stderr during the load (a log line) is held
and logged a moment later, not lost.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Iterator

log = logging.getLogger("edgerun.engines.runtime")

# One redirection at a time: two loads in parallel threads must not restore each other's descriptor.
_lock = threading.Lock()


@contextlib.contextmanager
def native_stderr_to_log(source: str) -> Iterator[None]:
    """Hold what native code writes to fd 2 inside the block; log it per line afterwards, naming ``source``."""
    with _lock, tempfile.TemporaryFile() as held:
        sys.stderr.flush()  # Python's own buffered text goes out first, to the real stderr
        saved = os.dup(2)
        try:
            os.dup2(held.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
        finally:
            os.close(saved)
        held.seek(0)
        text = held.read().decode("utf-8", "replace")
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith(("INFO: ", "VERBOSE: ")):
            log.debug("%s: %s", source, line)
        else:
            log.warning("%s: %s", source, line)
