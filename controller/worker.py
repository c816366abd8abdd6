"""A Monarch worker: one per host of a multi-host run, running Monarch's worker loop. It waits for a controller to
attach and spawn the run's processes here, and serves until its host is shut down:

- `--placement hosts --placement.workers tcp://HOST:PORT,...` attaches to workers started by hand or by `srun`;
- `--placement k8s` without --placement.k8s-image attaches to pods already running: this is their command, at
  the pod's IP and the port Monarch looks for (26600, or the container's MONARCH_PORT).

    python -m meshrl.controller.worker --address tcp://$(hostname):26600     # on each node
    python -m meshrl.controller.worker --address tcp://$(POD_IP):26600       # a pod (POD_IP: status.podIP)

(`--placement slurm` and `--placement process` start Monarch's own worker on each host: nothing to start there.)
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--address", required=True, help="where this worker listens, e.g. tcp://0.0.0.0:26600 (the controller dials "
        "this host's name or address on that port)"
    )  # fmt: skip
    args = parser.parse_args(argv)
    from monarch.actor import run_worker_loop_forever

    from meshrl.controller.process import export_import_path

    export_import_path()  # user code named by import path imports in the processes spawned here, too
    print(f"[meshrl] worker listening on {args.address}", flush=True)
    run_worker_loop_forever(ca="trust_all_connections", address=args.address)


if __name__ == "__main__":
    main()
