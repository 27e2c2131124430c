"""The sandbox zygote: imports the parser once, then forks one short-lived child per upload.

Started by `server.admin.sandbox.Sandbox` as ``python -m fedsplit.server.admin.zygote`` with HDF5
plugin loading disabled in its environment. It is single-threaded, so forking it is safe (a
multi-threaded web server is not), and a child costs milliseconds instead of an interpreter
start. Protocol on stdin/stdout, one JSON object a line: the parent sends
``{"source", "dest", "result", "request"}``; the zygote forks and answers ``{"pid": N}``; the
child writes its result to the ``result`` path and exits. The zygote exits when stdin closes.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from fedsplit.server.admin import inspect_worker
from fedsplit.server.admin.inspection import InspectRequest


def main() -> None:
    """Serve fork requests until stdin closes."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps children: no zombies
    os.umask(0o077)  # canonical copies and answers: readable by the server's user only
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                request = InspectRequest.from_json(job["request"])
                inspect_worker.run(job["source"], job["dest"], request, job["result"])
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        sys.stdout.write(json.dumps({"pid": pid}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
