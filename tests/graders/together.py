"""Shell grader: like `pyfuncs.together`, 1.0 once `answer` graders are running at once (pid files in the
folder given as the completion), 0.0 after 20 s without."""
import json
import os
import sys
import time
from pathlib import Path

req = json.load(sys.stdin)
folder, needed = Path(req["completion"]), int(req["answer"])
(folder / f"{os.getpid()}.{time.monotonic_ns()}").touch()
deadline = time.monotonic() + 20
while time.monotonic() < deadline:
    if len(list(folder.iterdir())) >= needed:
        print(1.0)
        sys.exit(0)
    time.sleep(0.01)
print(0.0)
