"""How the e2e runner scripts hand their result to the test process.

Printed after ``RESULT:`` for people, and written to the file named by
``OVERLAY_RESULT_FILE`` for the tests: with PP or a multiprocess engine,
worker processes share stdout and their log lines can land on the same line.
"""

from __future__ import annotations

import json
import os


def emit(result) -> None:
    text = json.dumps(result)
    if os.environ.get("OVERLAY_RESULT_FILE"):
        with open(os.environ["OVERLAY_RESULT_FILE"], "w") as f:
            f.write(text)
    print("RESULT:" + text, flush=True)
