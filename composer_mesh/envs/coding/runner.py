"""Runs one test module's `test_*` functions inside the sandbox and prints one line per test. Stdlib only: its
source is passed with `-c` (`python -I -S -B -c SOURCE MODULE`; `-B`: no `__pycache__` in the work dir, which `-I`
would write despite the sandbox's PYTHONDONTWRITEBYTECODE), composer_mesh is not importable in the sandbox.

Each result line is `\\n<tag> PASS <name>` or `\\n<tag> FAIL <name> <error>`, printed as it finishes (so a run
killed by its wall time still reports the tests before). The tag is read from stdin before the episode's code
is imported, so a stray print of the code is not read as a result line. It runs the visible tests only (the
`run_tests` tool): grading never imports test code next to the solution (`judge.py` says why).
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
