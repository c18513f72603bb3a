"""unisonrun, the launcher, and `unison.run(func)`, its form for Python.

    launch.py          the command line's entry: which way of starting ranks this job takes
    command_line.py    the options, their checks, and the UNISON_* variables they set
    config_file.py     horovodrun's --config-file
    processes.py       a rank's process: starting, output, signals; the Job that waits on them
    local.py           every rank on this host
    ssh.py             ranks on other hosts over ssh, meeting over TCP
    mpi.py             ranks started by mpirun
    elastic_driver.py  the elastic driver: rounds of workers on hosts that come and go
    hosts.py           -H and --hostfile
    rank_environment.py  what of the launcher's environment a rank gets
    function.py        unison.run(func): the launcher called from Python
    function_rank.py   a rank's entry point for unison.run(func)
    torchrun.py        ranks that torchrun started: init() takes its variables

Importing this package imports none of them: the rank-side entry points
(`python -m unison.runner.ssh`, `...mpi`, `...function_rank`) load only what they
use."""
