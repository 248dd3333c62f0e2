"""Stand-ins for what a cluster's scheduler does when it starts a job's processes, so that
the launch recipes of launch/ run unchanged on local processes (test_multihost.py).

Each fakes only the scheduler's part: which processes start, with which environment.

  fake_schedulers.py srun ARGV...      SLURM's srun: SLURM_NNODES tasks of ARGV, each with
                                       the SLURM_* variables JAX's SLURM detection reads
                                       (node list "localhost": every node is this host).
  fake_schedulers.py gcloud ARGS...    `gcloud compute tpus tpu-vm ssh NAME --worker=all
                                       --command=CMD`: CMD on FAKE_WORKERS workers, each given
                                       what a TPU VM's metadata server tells JAX (the
                                       coordinator, the worker count, its number) as flags,
                                       since no CPU host has that server.
  fake_schedulers.py k8s JOB.yaml      An Indexed Job's pods: the container's command with
                                       $(VAR) expanded from its env plus JOB_COMPLETION_INDEX;
                                       the coordinator pod's DNS name is this host
                                       (FAKE_COORDINATOR); FAKE_POD_ENV (JSON) sets env values
                                       and FAKE_EXTRA_ARGS (JSON) appends arguments.

Task i writes FAKE_SCHEDULER_DIR/task<i>.out, .err, .pid and, when it exits,
task<i>.rc ("<exit code> <time.time()>"). The fake exits with the first non-zero code.
"""

import json
import os
import re
import subprocess
import sys
import time


def spawn(tasks) -> int:
    """Runs [(argv, env)] at once; records each task's output, pid and exit."""
    out = os.environ["FAKE_SCHEDULER_DIR"]
    procs = []
    for i, (argv, env) in enumerate(tasks):
        with open(f"{out}/task{i}.out", "w") as o, open(f"{out}/task{i}.err", "w") as e:
            procs.append(subprocess.Popen(argv, env=env, stdout=o, stderr=e))
        with open(f"{out}/task{i}.pid", "w") as f:
            f.write(str(procs[-1].pid))
    codes = {}
    while len(codes) < len(procs):
        for i, p in enumerate(procs):
            if i not in codes and p.poll() is not None:
                codes[i] = p.returncode
                with open(f"{out}/task{i}.rc", "w") as f:
                    f.write(f"{p.returncode} {time.time()}")
        time.sleep(0.05)
    return next((c for c in codes.values() if c), 0)


def srun(argv):
    n = int(os.environ["SLURM_NNODES"])
    return spawn([(argv, {**os.environ, "SLURM_NTASKS": str(n), "SLURM_PROCID": str(i),
                          "SLURM_LOCALID": "0", "SLURM_STEP_NODELIST": "localhost",
                          "SLURM_STEP_NUM_NODES": str(n)}) for i in range(n)])


def gcloud(args):
    assert args[:4] == ["compute", "tpus", "tpu-vm", "ssh"], args
    assert "--worker=all" in args, args
    command = next(a.split("=", 1)[1] for a in args if a.startswith("--command="))
    with open(os.path.join(os.environ["FAKE_SCHEDULER_DIR"], "gcloud_args.json"), "w") as f:
        json.dump(args, f)
    n = int(os.environ["FAKE_WORKERS"])
    metadata = (f" --config.mesh.coordinator_address={os.environ['FAKE_COORDINATOR']}"
                f" --config.mesh.num_processes={n}")
    return spawn([(["bash", "-c", f"exec {command}{metadata} --config.mesh.process_id={i}"],
                   dict(os.environ)) for i in range(n)])


def k8s(path):
    import yaml
    with open(path) as f:
        job = next(d for d in yaml.safe_load_all(f) if d["kind"] == "Job")
    service = job["spec"]["template"]["spec"]["subdomain"]
    container = job["spec"]["template"]["spec"]["containers"][0]
    pod_env = {e["name"]: str(e["value"]) for e in container.get("env", [])}
    pod_env.update(json.loads(os.environ.get("FAKE_POD_ENV", "{}")))
    # DNS: pod 0 of the Job behind its headless Service is this host.
    pod0 = f"{job['metadata']['name']}-0.{service}"
    pod_env = {k: re.sub(rf"{re.escape(pod0)}:\d+", os.environ["FAKE_COORDINATOR"], v)
               for k, v in pod_env.items()}
    tasks = []
    for i in range(int(job["spec"]["completions"])):
        env = {**pod_env, "JOB_COMPLETION_INDEX": str(i)}
        argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["command"]]
        tasks.append((argv + json.loads(os.environ.get("FAKE_EXTRA_ARGS", "[]")),
                      {**os.environ, **env}))
    return spawn(tasks)


if __name__ == "__main__":
    what, rest = sys.argv[1], sys.argv[2:]
    sys.exit({"srun": srun, "gcloud": gcloud, "k8s": lambda a: k8s(a[0])}[what](rest))
