"""Worker command of the partition test: starts ``bulkhead-worker``, and the first
incarnation of slot ``$PARTITION_SLOT`` as uid ``$PARTITION_UID`` (keeping file access), so
the test's ``ip rule ... uidrange`` cuts that one process off from its peers. It also
writes the control endpoint's port to ``$PARTITION_DIR/control-port``: the victim keeps
reaching the manager."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from urllib.parse import urlparse

from bulkhead.api.protocol import ENDPOINT_ENV, WORKER_ENV

worker = os.environ[WORKER_ENV]
port = urlparse(os.environ[ENDPOINT_ENV]).port
Path(os.environ["PARTITION_DIR"], "control-port").write_text(str(port))
command = [str(Path(sys.executable).with_name("bulkhead-worker"))]
if worker.endswith(f"-w{os.environ['PARTITION_SLOT']}-0"):
    caps = "+dac_override,+dac_read_search"
    command = [
        "setpriv", f"--reuid={os.environ['PARTITION_UID']}", "--regid=0", "--clear-groups",
        f"--inh-caps={caps}", f"--ambient-caps={caps}", "--", *command,
    ]  # fmt: skip
os.execvp(command[0], command)
