"""Runs one test module's `test_*` functions inside the sandbox and prints one line per test. Stdlib only: its
source is passed with `-c` (`python -I -S -c SOURCE MODULE`), composer_mesh is not importable in the sandbox.

Each result line is `\\n<tag> PASS <name>` or `\\n<tag> FAIL <name> <error>`, printed as it finishes (so a run
killed by its wall time still reports the tests before). The tag is read from stdin before the episode's code
is imported: when grading it is a fresh random nonce, so the solution cannot print passing lines of its own.
"""

import sys
import traceback


def main(module_name: str) -> None:
    """Import `module_name` from the working directory and run its tests in file order."""
    tag = sys.stdin.readline().strip() or "TEST"
    sys.path.insert(0, ".")  # only now: the runner's own imports are done, the episode's files cannot shadow them
    try:
        module = __import__(module_name)
    except BaseException:
        print(f"\n{tag} ERROR import {_last_line()}", flush=True)
        return
    tests = [(n, f) for n, f in vars(module).items() if n.startswith("test_") and callable(f)]
    for name, test in tests:
        try:
            test()
        except BaseException:
            print(f"\n{tag} FAIL {name} {_last_line()}", flush=True)
        else:
            print(f"\n{tag} PASS {name}", flush=True)


def _last_line() -> str:
    lines = traceback.format_exc().strip().splitlines()
    return lines[-1][:300] if lines else "error"


if __name__ == "__main__":
    main(sys.argv[1])
