"""Where the repository and the tests' data are, for test modules at any depth of tests/."""
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
TASK_SUITES = REPO / "tests" / "task_suites"
