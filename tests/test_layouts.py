"""One identity test over every row of tests/layouts.py: each rank of
each layout learns its rank, local rank and size, cross rank and size and
whether hosts are even, the backend the row promises, and a collective
among them gives every rank what every other sent. The rows that need MPI
run in the `mpi` and `openmpi` tox envs, which build the core with it."""
import sys

import pytest

from jobs import IDENTITY, unisonrun
from layouts import LAYOUTS, identity, launch, needs_mpi, ranks
from unison import basics

BUILT_WITH_MPI = "mpi" in basics.built_backends()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", LAYOUTS)
def test_every_rank_of_each_layout_has_its_identity_and_backend(tmp_path, name):
    if needs_mpi(name) and not BUILT_WITH_MPI:
        pytest.skip("unison was built without MPI; the tox envs 'mpi' and 'openmpi' run this layout")
    script = tmp_path / "identity.py"
    script.write_text(IDENTITY)
    options, base = launch(name, tmp_path)
    proc = unisonrun(options, [sys.executable, str(script)], timeout=100, base=base)
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, output
    n = ranks(name)
    total = n * (n + 1) // 2  # every rank's rank + 1, summed
    mpirun = "" if needs_mpi(name) else " mpirun None"  # no MPI on PATH, and none needed
    for r in range(n):
        line = "rank %d of %d: %s total %d who %s%s" % (r, n, LAYOUTS[name].backend, total, identity(name), mpirun)
        assert ("[%d]<stdout>:" % r if n > 1 else "") + line in output, output
