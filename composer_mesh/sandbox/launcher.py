"""The first process inside a sandbox: sets the resource limits, drops root to the slot's uid, then execs the
command. Stdlib only: its source is passed to the sandbox's interpreter with `-c` (composer_mesh itself is not
importable there), as `python -c SOURCE LIMITS_JSON COMMAND...`.

Why limits are set here and not on bubblewrap: the process limit of a user namespace counts from the limit its
creator had, so bubblewrap itself runs unlimited and only what it starts is limited; and setting them after
bubblewrap built the sandbox keeps the address-space limit off bubblewrap's own setup.
"""

import json
import os
import resource
import sys


def main(argv: list[str]) -> None:
    """Apply `argv[0]` (JSON: cpu_s, memory_mb, processes, file_mb, uid) and exec `argv[1:]`."""
    limits = json.loads(argv[0])
    mb = 1024 * 1024
    for name, value in (("RLIMIT_CPU", (limits["cpu_s"], limits["cpu_s"] + 1)),
                        ("RLIMIT_AS", (limits["memory_mb"] * mb,) * 2),
                        ("RLIMIT_FSIZE", (limits["file_mb"] * mb,) * 2),
                        ("RLIMIT_CORE", (0, 0))):
        resource.setrlimit(getattr(resource, name), value)
    if os.getuid() == 0:  # root ignores RLIMIT_NPROC: run as the slot's own uid
        os.setgroups([])
        os.setgid(limits["uid"])
        os.setuid(limits["uid"])
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"],) * 2)
    os.umask(0o022)
    try:
        os.execvp(argv[1], argv[1:])
    except OSError as e:
        sys.stderr.write(f"sandbox: cannot run {argv[1]!r}: {e.strerror}\n")
        os._exit(127)


if __name__ == "__main__":
    main(sys.argv[1:])
