"""Launching several processes: the torchrun command for `finetune run --nproc N`, and a parent
that passes a scheduler's signals on to it.

    cmd = launch_command(args)        # python -m torch.distributed.run ... -m finetune run RECIPE ...
    rc = run_launcher(cmd, launch_env(args))   # 75 when the workers checkpointed on SIGTERM/SIGUSR1

`args` carries the `run` command's options (nproc, nnodes, node_rank, master_addr,
master_port, max_restarts, recipe, overrides, no_progress, skip_memory_check, rewards). Another
launcher (Slurm's srun, a Kubernetes PyTorchJob, accelerate launch) replaces this module:
each worker then runs `finetune run RECIPE` with the rendezvous in its environment.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from finetune.errors import Preempted

EXIT_DIR = "FINETUNE_EXIT_DIR"  # a folder where each worker writes its exit code as roundR.rankN (mark_exit)
ELASTIC_WORLD = "FINETUNE_ELASTIC_WORLD"  # an elastic job's most processes: its first start sizes the step for them
ELASTIC_RESTARTS = 3  # --nnodes MIN:MAX without --max-restarts: a lost node costs one


def mark_exit(code: int) -> None:
    """Tell the launcher of `finetune run --nproc` how this worker ends (torchrun says only 'failed'): a crash
    on one rank makes its peers see a closed connection and leave restartable, but the job is not."""
    folder = os.environ.get(EXIT_DIR)
    if folder and os.path.isdir(folder):
        name = f"round{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}.rank{os.environ.get('RANK', '0')}"
        Path(folder, name).write_text(str(code))


def job_exit(folder: Path) -> int | None:
    """75 when every worker that said how it ended in the last restart round left restartable; None otherwise."""
    said = [(int(p.name[5:].split(".")[0]), p.read_text()) for p in folder.glob("round*.rank*")]
    last = max((r for r, _ in said), default=None)
    codes = {code for r, code in said if r == last}
    return Preempted.exit_code if codes == {str(Preempted.exit_code)} else None


def add_launch_arguments(run: argparse.ArgumentParser) -> None:
    """`finetune run`'s options for several processes: what launch_command reads."""
    dist = run.add_argument_group("multi-process (through torchrun)")
    dist.add_argument("--nproc", type=int, default=1, help="processes on this node, one per GPU (default 1)")
    dist.add_argument(
        "--nnodes",
        type=node_range,
        default=(1, 1),
        help="nodes in the job (default 1), or MIN:MAX for an elastic job that goes on, resumed, on the nodes that remain",
    )
    dist.add_argument("--node-rank", type=int, default=0, help="this node's rank, 0..nnodes-1 (an elastic job numbers them)")
    dist.add_argument(
        "--elastic-wait",
        type=_seconds,
        default=30,
        help="--nnodes MIN:MAX: seconds a rendezvous waits for more nodes once MIN have joined (default 30)",
    )
    dist.add_argument("--master-addr", default="127.0.0.1", help="address of node 0 (rendezvous host)")
    dist.add_argument("--master-port", type=int, default=29500, help="rendezvous port on node 0")
    dist.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        help="restart all workers this often when one fails; they resume from the last checkpoint (default 0; 3 with "
        "--nnodes MIN:MAX)",
    )


def node_range(text: str) -> tuple[int, int]:
    """--nnodes N, or MIN:MAX (elastic), as (MIN, MAX)."""
    low, colon, high = text.partition(":")
    try:
        nodes = (int(low), int(high if colon else low))
    except ValueError:
        nodes = (0, 0)
    if not 1 <= nodes[0] <= nodes[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: a node count N >= 1, or MIN:MAX with 1 <= MIN <= MAX for an elastic job")
    return nodes


def _seconds(text: str) -> int:
    """--elastic-wait: whole seconds >= 1 (torch's rendezvous reads an integer timeout)."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: whole seconds, at least 1")
    return int(text)


def elastic(args: argparse.Namespace) -> bool:
    """--nnodes MIN:MAX with MIN < MAX: the job goes on on the nodes that remain."""
    low, high = args.nnodes
    return low < high


def restarts(args: argparse.Namespace) -> int:
    """How often torchrun restarts the workers: --max-restarts, or ELASTIC_RESTARTS for an elastic job that was given
    none (losing a node restarts the workers that remain)."""
    if args.max_restarts is None:
        return ELASTIC_RESTARTS if elastic(args) else 0
    return args.max_restarts


def launch_command(args: argparse.Namespace) -> list[str]:
    """The torchrun command that runs this recipe on args.nproc processes (per node).

    torchrun (torch.distributed.run) does the rendezvous, sets RANK/WORLD_SIZE for
    accelerate, and with --max-restarts restarts every worker when one dies; the
    restarted workers continue from the newest complete checkpoint (resume=auto).
    With --nnodes MIN:MAX a restart meets on the nodes that answer, as long as MIN do; the
    resumed run keeps its examples per step on fewer or more replicas (trainer/order.py).
    """
    (low, high), again, grows = args.nnodes, restarts(args), elastic(args)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc)]
    cmd += ["--nnodes", f"{low}:{high}" if grows else str(high), "--max_restarts", str(again)]
    if again > 0 or grows:
        # Elastic: the c10d rendezvous lets restarted workers (a new round) meet again; the
        # static one can leave them unable to reconnect. Node 0 hosts it at --master-addr:--master-port.
        cmd += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"{args.master_addr}:{args.master_port}", "--rdzv_id", "finetune"]
        cmd += ["--node_rank", str(args.node_rank)] if high > 1 and not grows else []  # elastic: ranks in order of arrival
        cmd += ["--rdzv_conf", f"last_call_timeout={args.elastic_wait}"] if grows else []
    elif high > 1:
        # Static rendezvous: node 0 hosts it at --master-addr:--master-port, the others join.
        cmd += ["--node_rank", str(args.node_rank), "--master_addr", args.master_addr, "--master_port", str(args.master_port)]
    else:
        cmd += ["--master_addr", args.master_addr, "--master_port", str(args.master_port)]
    cmd += ["-m", "finetune", "run", args.recipe, *args.overrides]
    cmd += ["--no-progress"] if args.no_progress else []
    cmd += ["--skip-memory-check"] if args.skip_memory_check else []
    cmd += ["--rewards", args.rewards] if getattr(args, "rewards", None) else []
    return cmd


def launch_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment torchrun runs in.

    With --max-restarts, each restart round must meet on a fresh store: torch's c10d
    rendezvous otherwise hands the restarted workers the TCPStore of the first round
    (pytorch/pytorch#135712), where the dead rank's keys still hold its old address, and
    the new gloo mesh tries to connect to it (connectFullMesh refused). Opting out of the
    store sharing makes rank 0 of every round host a new store.
    """
    env = dict(os.environ)
    # NCCL's watchdog raises in the training thread at distributed.timeout_s (2) instead of killing the process
    # (torchrun's 1): the rank then leaves restartable (trainer/faults.py). Unverified on a GPU here.
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    if restarts(args) > 0:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if elastic(args):
        env[ELASTIC_WORLD] = str(args.nproc * args.nnodes[1])
    return env


def run_launcher(cmd: list[str], env: dict[str, str] | None = None) -> int:
    """Run torchrun, passing on the signals a scheduler sends before it kills a job.

    SIGTERM/SIGUSR1 (Slurm, Kubernetes) and SIGINT go to torchrun, which hands them to
    the workers; they checkpoint at the next step and stop. Without this the launcher
    would die alone and leave the workers running unsupervised.
    """
    import signal
    import subprocess

    exits = tempfile.TemporaryDirectory(prefix="finetune-exits-")  # where a worker says it left restartable
    child = subprocess.Popen(cmd, env={**(env if env is not None else os.environ), EXIT_DIR: exits.name})
    forwarded: list[int] = []

    def forward(signum, frame):
        forwarded.append(signum)
        # torchrun turns SIGTERM into a stop of its workers; SIGUSR1 is ours, sent as SIGTERM too.
        child.send_signal(signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        rc = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    restartable = job_exit(Path(exits.name))
    exits.cleanup()
    if forwarded and rc != 0:
        # The workers checkpointed and stopped (exit 75); torchrun reports that as a failure.
        print("preempted: the workers saved a checkpoint; rerun the same command with resume=auto", file=sys.stderr)
        return Preempted.exit_code
    if restartable and rc != 0:
        # Ranks found another gone or hung (trainer/faults.py), and none failed otherwise: a restart fixes it.
        print(
            "the workers left restartable (a rank stopped answering or ran out of memory): rerun the same command "
            "with resume=auto (or give --max-restarts) to continue from the last complete checkpoint",
            file=sys.stderr,
        )
        return Preempted.exit_code
    return rc


STALE_LOCK_S = 600  # an extension build (DeepSpeed's ops) holds its lock for a minute or two, not ten


def stale_build_locks(root: Path | None = None, now: float | None = None) -> list[str]:
    """Warnings for torch extension build locks left by a killed build: every later launch that builds that op
    (DeepSpeed's shm comm op on CPU, its fused Adam on GPU) waits on such a lock forever, before the first step."""
    import time

    if root is None:
        from torch.utils.cpp_extension import get_default_build_root

        root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    now = time.time() if now is None else now
    old = [p for p in sorted(Path(root).glob("*/*/lock")) if now - p.stat().st_mtime > STALE_LOCK_S]
    return [
        f"warning: {p} is {int((now - p.stat().st_mtime) // 60)} min old: a torch extension build that was killed "
        "leaves it, and every launch that builds that op then waits on it forever; if no build is running, delete it"
        for p in old
    ]
