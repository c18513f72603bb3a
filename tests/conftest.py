import os

# tests/parallel holds per-rank suites; tests/test_parallel.py runs them
# under the launcher. Collected directly, outside a rank, they are skipped.
collect_ignore = [] if os.environ.get("UNISON_SIZE") else ["parallel"]
