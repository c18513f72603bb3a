"""Every rank on this host: the launcher's simplest way of starting ranks."""
from unison.runner import rank_environment
from unison.runner.processes import Launch


def launches(args, job_id, base):
    """Every rank on this host."""
    n = args.np
    launches = []
    for rank in range(n):
        env = dict(base)
        env.update(rank_environment.with_horovods_names({
            "UNISON_RANK": str(rank), "UNISON_SIZE": str(n),
            "UNISON_LOCAL_RANK": str(rank), "UNISON_LOCAL_SIZE": str(n),
            "UNISON_CROSS_RANK": "0", "UNISON_CROSS_SIZE": "1",
            "UNISON_JOB_ID": job_id,
        }))
        launches.append(Launch(rank, args.command, env))
    return launches
