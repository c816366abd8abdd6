"""A Monarch worker: one per host of a multi-host run. It waits for a controller started with `--placement hosts
--placement.workers ...` to attach and spawn the run's processes here, and serves until its host is shut down.

    python -m meshrl.controller.worker --address tcp://0.0.0.0:26600     # on each node (by hand, srun, a pod)
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

    from meshrl.controller.api import _export_import_path

    _export_import_path()  # user code named by import path imports in the processes spawned here, too
    print(f"[meshrl] worker listening on {args.address}", flush=True)
    run_worker_loop_forever(ca="trust_all_connections", address=args.address)


if __name__ == "__main__":
    main()
