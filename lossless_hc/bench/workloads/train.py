"""Data-parallel training driver for the examples, `make demo` and the tests.

    horovodrun -np 2 -H localhost:2 --gloo python -m lossless_hc.bench.workloads.train --model ncf \
        --framework horovod --compression lossless
    torchrun --standalone --nproc_per_node 2 -m lossless_hc.bench.workloads.train --model ncf --framework ddp ...
    torchrun --standalone --nproc_per_node 4 -m lossless_hc.bench.workloads.train --model ncf --framework fsdp \
        --shards 2 --compression lossless     # 2 replicas x 2 shards, the replica all-reduce compressed

Every rank builds the same model from the same seed and draws its own batches; rank 0 prints loss,
accuracy, bytes sent per step vs dense, step time and fallbacks, and optionally writes them as JSON
(``--json``) and the final parameters (``--save-params``) for comparisons between runs.
"""
from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import time
from typing import Optional

import torch

from lossless_hc.bench.common import leave
from lossless_hc.bench.cluster_report import AUTO, AUTO_EXACT
from lossless_hc.bench.workloads.options import (LAUNCH_SCRIPTS, TORCH_ENV, ArgumentParser, HelpFormatter,
                                                 detect_launcher, device, fraction, launch_error, local_rank,
                                                 non_negative_float, non_negative_int, positive_int, thc_bits)
from lossless_hc.bench.workloads.replay import ReplayWorkload
from lossless_hc.bench.workloads.tasks import DEFAULTS as TASK_DEFAULTS
from lossless_hc.bench.workloads.tasks import OPTIMIZERS, coalesce_sparse_state
from lossless_hc.bench.workloads.tasks import WORKLOADS as TASKS

WORKLOADS = {**TASKS, "replay": ReplayWorkload}
# replay: plain SGD (the optimizer's cost is not what a replay measures) at a small step
DEFAULTS = {**TASK_DEFAULTS, "replay": dict(batch=1, optimizer="sgd", lr=0.01, steps=20)}

# sparse: nn.Embedding(sparse=True) aggregated by the framework's own sparse path (Horovod: allgather
# of values and indices, no sparse_as_dense; DDP/Gloo: sparse allreduce, itself an allgather).
# topk-allgather: the baseline of lossless_hc.bench.workloads.topk_allgather; topk: ours (top-k + lossless).
# bf16, powersgd: torch's own DDP hooks (bf16_compress_hook; PowerSGDState + powerSGD_hook with
# --powersgd-rank and --powersgd-start); DDP only (Horovod cannot reduce bfloat16 tensors and has
# no low-rank compressor). auto, auto-lossy: the planner (lossless_hc.training.planner) picks per
# tensor among the exact strategies, or among all of them. auto-sparse: DDP's auto_hook with
# nn.Embedding(sparse=True), the sparse tables planned over their listed rows (what auto does for a
# DDP user on Gloo with sparse embeddings; "auto" keeps dense embeddings, as NCCL, which has no sparse
# allreduce, requires). auto-lossy-sparse: the same with lossy=True (what a user allowing loss gets over
# sparse embeddings: the tables are planned among the exact strategies, the dense tensors among all).
# Horovod sends sparse gradients to hvd.sparse_allreduce outside any compressor.
COMPRESSIONS = ("none", "fp16", "bf16", "powersgd", "sparse", "topk-allgather", "lossless", "topk", "thc",
                "auto", "auto-lossy", "auto-sparse", "auto-lossy-sparse")
SPARSE_MODES = ("sparse", "auto-sparse", "auto-lossy-sparse")   # modes that imply --sparse-embeddings
SUPPORTED = {  # compressions each framework implements here
    "horovod": ("none", "fp16", "sparse", "topk-allgather", "lossless", "topk", "thc", "auto", "auto-lossy"),
    "ddp": COMPRESSIONS,
    "fsdp": ("none", "fp16", "bf16", "lossless", "topk", "thc", "auto", "auto-lossy"),
    "local": COMPRESSIONS,
}


# -- frameworks ------------------------------------------------------------------------------------
# A framework this process has already initialised (hvd.init, init_process_group) is used as it is and
# left initialised at shutdown: tests/mp/several_trainings.py runs several trainings in one
# initialisation, since a second init_process_group under torchrun would meet the first one's keys in
# the agent's store (the default group's name restarts at "0").
class Horovod:
    def __init__(self, args):
        import horovod.torch as hvd

        self.hvd = hvd
        self.owner = not hvd.is_initialized()
        if self.owner:
            hvd.init()
        self.rank, self.size = hvd.rank(), hvd.size()
        self.compressor = None

    def wrap(self, model, opt, args):
        hvd = self.hvd
        from lossless_hc.plugins.horovod import Compression

        if args.compression == "lossless":
            self.compressor = Compression.lossless(max_density=args.max_density)
        elif args.compression == "topk":
            self.compressor = Compression.topk(ratio=args.topk_ratio)
        elif args.compression == "thc":
            self.compressor = Compression.thc(bits=args.thc_bits)
        elif args.compression in ("auto", "auto-lossy"):
            self.compressor = Compression.auto(lossy=args.compression == "auto-lossy")
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        if args.compression == "topk-allgather":
            from lossless_hc.bench.workloads.topk_allgather import HorovodTopKAllgatherOptimizer
            wrapped = HorovodTopKAllgatherOptimizer(opt, model.named_parameters(), args.topk_ratio, hvd)
            self.compressor = wrapped.codec
            return model, wrapped
        comp = {"none": Compression.none, "fp16": Compression.fp16,
                "sparse": Compression.none}.get(args.compression, self.compressor)
        # "sparse" leaves sparse embedding gradients to Horovod's allgather path; the other modes
        # densify them (sparse_as_dense) so that an allreduce compressor sees them.
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=comp,
                                       op=hvd.Average,
                                       sparse_as_dense=args.sparse_embeddings and args.compression != "sparse")
        return model, opt

    def barrier(self):
        self.hvd.allreduce(torch.zeros(1), name="train.barrier")

    def stats(self):
        return self.compressor.stats() if self.compressor else None

    def shutdown(self):
        if self.owner:
            self.hvd.shutdown()


class DDP:
    def __init__(self, args):
        import torch.distributed as dist

        self.dist = dist
        # Gloo between CPU workers; NCCL when each worker trains on its own GPU.
        self.owner = not dist.is_initialized()
        if self.owner:
            missing = [k for k in TORCH_ENV if k not in os.environ]
            if missing:   # init_process_group's env:// would raise, on a plain process, about RANK alone
                raise SystemExit(f"--framework {args.framework}: torch.distributed's {', '.join(missing)} not set; "
                                 f"launch with {LAUNCH_SCRIPTS['torch']} NP SCRIPT ... (torchrun sets them)")
            dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.state = None

    def wrap(self, model, opt, args):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        from lossless_hc.plugins.ddp import (AutoHookState, LosslessHookState, THCHookState, TopKHookState, auto_hook,
                                             lossless_hook, thc_hook, topk_hook)

        ddp = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if args.device == "cuda" else None)
        if args.compression == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif args.compression == "bf16":
            from lossless_hc.bench.workloads.baselines import bf16_hook
            ddp.register_comm_hook(None, bf16_hook)
        elif args.compression == "powersgd":
            from lossless_hc.bench.workloads.baselines import PowerSGDPerBucket, powersgd_hook

            # error feedback and warm start on (torch's defaults); plain allreduce for the first
            # --powersgd-start iterations, as torch recommends
            self.powersgd = PowerSGDPerBucket(matrix_approximation_rank=args.powersgd_rank,
                                              start_powerSGD_iter=args.powersgd_start, min_compression_rate=2,
                                              random_seed=args.seed)
            ddp.register_comm_hook(self.powersgd, powersgd_hook)
        elif args.compression in AUTO:
            # auto-sparse: the same hook; the sparse tables' buckets arrive sparse (--sparse-embeddings)
            self.state = AutoHookState(lossy=args.compression not in AUTO_EXACT)
            ddp.register_comm_hook(self.state, auto_hook)
        elif args.compression == "lossless":
            self.state = LosslessHookState(max_density=args.max_density)
            ddp.register_comm_hook(self.state, lossless_hook)
        elif args.compression == "topk":
            self.state = TopKHookState(ratio=args.topk_ratio)
            ddp.register_comm_hook(self.state, topk_hook)
        elif args.compression == "thc":
            exact = output_layer_parameters(model) if args.thc_exact == "output" else ()
            self.state = THCHookState(bits=args.thc_bits, exact=exact)
            ddp.register_comm_hook(self.state, thc_hook)
        elif args.compression == "topk-allgather":
            from lossless_hc.bench.workloads.topk_allgather import TopKAllgather, ddp_topk_allgather_hook
            self.state = TopKAllgather(args.topk_ratio)
            ddp.register_comm_hook(self.state, ddp_topk_allgather_hook)
        return ddp, opt

    def barrier(self):
        self.dist.barrier()

    def stats(self):
        return self.state.stats() if self.state else None

    def shutdown(self):
        if self.owner:
            self.dist.destroy_process_group()


def fsdp_refusal(args, world: Optional[int]) -> Optional[str]:
    """Why ``--framework fsdp`` cannot run ``args.compression`` on ``world`` ranks (None: unknown, which
    can refuse only where ``--shards`` is not given: one replica then), or None: a state that compresses
    the replica all-reduce only (thc) needs replicas and no ``--compress-reduce-scatter``."""
    state_type = FSDP.state_types().get(args.compression) if args.framework == "fsdp" else None
    if state_type is None or state_type.supports_reduce_scatter:
        return None
    shards = args.shards or world
    one_replica = args.shards is None or (world is not None and world // shards == 1)
    if not (one_replica or args.compress_reduce_scatter):
        return None
    if not one_replica:
        fix = "drop --compress-reduce-scatter"
    elif args.shards is None:
        fix = "without --shards every rank is in one shard group (no replicas): pass --shards with a divisor of " \
              "the world size below it (HSDP)"
    else:
        fix = f"{world} ranks in shards of {shards} leave one replica: pass --shards with a divisor of {world} " \
              "below it (HSDP)"
    return (f"--framework fsdp --compression {args.compression} compresses the replica all-reduce only: {fix}, "
            "or use --compression lossless|topk|auto|auto-lossy (which fill the reduce-scatter too)")


class FSDP(DDP):
    """FSDP2 (``fully_shard``) over a ``(replicate, shard)`` mesh of ``--shards`` ranks per replica
    (default: all ranks, i.e. FSDP without replicas). Every child module with parameters and the root
    are sharded. ``none``: native FSDP2/HSDP on the mesh; ``fp16``/``bf16``: the same with FSDP2's own
    ``MixedPrecisionPolicy(reduce_dtype=...)`` (reduce-scatter and replica all-reduce in half
    precision, parameters and compute in float32). ``lossless``/``topk``/``thc``:
    ``lossless_hc.plugins.fsdp`` -- the replica all-reduce compressed (custom HSDP), and the
    reduce-scatter too when there is a single replica or with ``--compress-reduce-scatter``."""

    def __init__(self, args):
        from torch.distributed.device_mesh import init_device_mesh

        super().__init__(args)   # the process group (Gloo, or NCCL on GPUs), rank and size
        shards = args.shards or self.size
        if self.size % shards:   # parse_args checks it already where the launcher set WORLD_SIZE
            raise SystemExit(f"--shards {shards} must divide the world size {self.size}")
        why = fsdp_refusal(args, self.size)   # parse_args checks it already where the launcher set WORLD_SIZE
        if why:
            raise SystemExit(why)
        replicas = self.size // shards
        if replicas > 1:
            self.mesh = init_device_mesh(args.device, (replicas, shards), mesh_dim_names=("replicate", "shard"))
        else:
            self.mesh = init_device_mesh(args.device, (shards,), mesh_dim_names=("shard",))

    @staticmethod
    def state_types() -> dict:
        """``--compression`` -> the plugin state that implements it."""
        from lossless_hc.plugins.fsdp import AutoFSDPState, LosslessFSDPState, THCFSDPState, TopKFSDPState
        return {"auto": AutoFSDPState, "auto-lossy": AutoFSDPState, "lossless": LosslessFSDPState,
                "topk": TopKFSDPState, "thc": THCFSDPState}

    def wrap(self, model, opt, args):
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        native = args.compression in ("none", "fp16", "bf16")
        reduce_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.compression)
        policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
        on = self.mesh if native or self.mesh.ndim == 1 else self.mesh["shard"]
        for child in model.children():
            if any(p.requires_grad for p in child.parameters()):
                fully_shard(child, mesh=on, mp_policy=policy)
        fully_shard(model, mesh=on, mp_policy=policy)
        if native:
            if args.device != "cuda":   # Gloo has no AVG: sum, and let FSDP divide
                for m in model.modules():
                    if isinstance(m, FSDPModule):
                        m.set_force_sum_reduction_for_comms(True)
        else:
            options = {"auto": dict(lossy=False), "auto-lossy": dict(lossy=True),
                       "lossless": dict(max_density=args.max_density), "topk": dict(ratio=args.topk_ratio),
                       "thc": dict(bits=args.thc_bits)}[args.compression]
            self.state = self.state_types()[args.compression](self.mesh, **options)
            self.state.register(model, reduce_scatter=self.mesh.ndim == 1 or args.compress_reduce_scatter)
        # fully_shard replaced the parameters with DTensors: the optimizer must see those
        return model, type(opt)(model.parameters(), **opt.defaults)

    def full_state_dict(self, model) -> dict:
        """The unsharded parameters (a collective: every rank calls it)."""
        return {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}


class NoCommunication:
    """Each rank trains on its own, nothing aggregated: the compute-only reference of the cluster
    benchmark. Rank and world size come from RANK / WORLD_SIZE so that the thread split matches
    the distributed runs."""

    def __init__(self, args):
        self.rank, self.size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))

    def wrap(self, model, opt, args):
        return model, opt

    def stats(self):
        return None

    def barrier(self):
        pass

    def shutdown(self):
        pass


FRAMEWORKS = {"horovod": Horovod, "ddp": DDP, "fsdp": FSDP, "local": NoCommunication}


def interface_bytes(iface: str) -> dict:
    """Bytes sent and received so far on network interface ``iface`` (this network namespace)."""
    out = {}
    for key in ("tx_bytes", "rx_bytes"):
        try:
            with open(f"/sys/class/net/{iface}/statistics/{key}") as f:
                out[key] = int(f.read())
        except FileNotFoundError:
            raise SystemExit(f"--net-iface {iface}: no such network interface in this namespace") from None
    return out


def stats_delta(after, before):
    """Per-window statistics: the counters of ``after`` minus those of ``before``; the window's
    ``wire_ratio`` is its own payload bytes over its own dense bytes (a ratio does not subtract)."""
    if after is None:
        return None
    if before is None:
        return dict(after)
    out = {k: (v - before.get(k, 0) if isinstance(v, (int, float)) and k != "wire_ratio" else v)
           for k, v in after.items()}
    if "wire_ratio" in out and out.get("dense_bytes"):
        out["wire_ratio"] = out["payload_bytes"] / out["dense_bytes"]
    return out


# -- the loop --------------------------------------------------------------------------------------
def compression_help() -> str:
    """--compression's help: the modes, and those of each --framework, from SUPPORTED (so they cannot drift)."""
    groups: dict = {}
    for fw, modes in SUPPORTED.items():
        groups.setdefault(modes, []).append(fw)
    per = "; ".join(f"{' and '.join(fws)}: {'all' if modes == COMPRESSIONS else ', '.join(modes)}"
                    for modes, fws in groups.items())
    return f"one of {', '.join(COMPRESSIONS)} (default lossless). Per --framework -- {per}"


def parse_args(argv=None, default_model="ncf", env=None):
    """The driver's options from ``argv``, the per-model defaults filled in. ``env`` (default
    ``os.environ``): the environment the launcher set, which picks the default ``--framework`` (ddp under
    torchrun, horovod otherwise) and refuses a framework the launcher cannot start.

    A refused command line prints one line, ``PROG: error: MESSAGE (see --help)``, on stderr and raises
    :class:`~lossless_hc.bench.workloads.options.UsageError` (a SystemExit, status 2) before any process
    group or model exists: every rank refuses alike, with no traceback."""
    env = os.environ if env is None else env
    p = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--model", choices=sorted(WORKLOADS), default=default_model)
    p.add_argument("--framework", choices=sorted(FRAMEWORKS),
                   help="default: ddp when started by torchrun (scripts/launch_torchrun.sh), horovod otherwise "
                        "(scripts/launch_horovod.sh, scripts/launch_mpirun.sh); local: no aggregation at all "
                        "(compute-only reference)")
    p.add_argument("--compression", choices=COMPRESSIONS, default="lossless", metavar="MODE", help=compression_help())
    p.add_argument("--steps", type=positive_int, help="training steps (default per model)")
    p.add_argument("--batch", type=positive_int, help="per-rank batch (default per model)")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), help="default per model")
    p.add_argument("--lr", type=non_negative_float, help="learning rate (default per model)")
    p.add_argument("--max-density", type=fraction, default=0.03,
                   help="lossless: initial capacity per tensor, in (0, 1]")
    p.add_argument("--topk-ratio", type=fraction, default=0.01, help="topk: fraction of each tensor sent, in (0, 1]")
    p.add_argument("--thc-bits", type=thc_bits, default=4,
                   help="thc: a table of 2^bits levels, bits in [1, 16] (the wire's bits per coordinate follow "
                        "from the workers and granularity)")
    p.add_argument("--thc-exact", choices=("none", "output"), default="none",
                   help="ddp thc: 'output' sends the output layer over the vocabulary exactly "
                        "(THCHookState(exact=...); for Adam, see docs/THC.md)")
    p.add_argument("--powersgd-rank", type=positive_int, default=4, help="powersgd: matrix approximation rank")
    p.add_argument("--powersgd-start", type=non_negative_int, default=2,
                   help="powersgd: iterations of plain allreduce before PowerSGD starts (torch's start_powerSGD_iter)")
    p.add_argument("--shards", type=positive_int,
                   help="fsdp: ranks per replica, a divisor of the world size (default: all; fewer: custom HSDP)")
    p.add_argument("--compress-reduce-scatter", action="store_true",
                   help="fsdp with replicas: compress the reduce-scatter too (lossless, topk; auto: as rows)")
    p.add_argument("--sparse-embeddings", action="store_true",
                   help="nn.Embedding(sparse=True) (Horovod: aggregated with sparse_as_dense=True; DDP auto: "
                        "planned over the listed rows; implied by --compression sparse and auto-sparse)")
    p.add_argument("--users", type=positive_int, default=50_000)
    p.add_argument("--items", type=positive_int, default=50_000)
    p.add_argument("--dim", type=positive_int, default=32)
    p.add_argument("--vocab", type=positive_int, default=20_000)
    p.add_argument("--skew", type=non_negative_float, default=0.0,
                   help="ncf: Zipf exponent of the batches' users and negative items (0: uniform)")
    p.add_argument("--replay-dir", help="--model replay: recorded gradients (python -m lossless_hc.bench replay)")
    p.add_argument("--threads", type=non_negative_int, default=0,
                   help="intra-op threads per worker (0: this machine's cores / workers)")
    p.add_argument("--device", type=device, choices=("cpu", "cuda"), default="cpu",
                   help="cuda: one GPU per worker (LOCAL_RANK), NCCL for DDP")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="the model's parameters (and so its gradients) and float inputs in this dtype")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=positive_int, default=25)
    p.add_argument("--warmup", type=non_negative_int, default=0,
                   help="steps before the timed window (excluded from timings, statistics and wire bytes)")
    p.add_argument("--net-iface", help="report bytes sent/received on this interface during the timed window")
    p.add_argument("--json", help="rank 0 writes the results here; with '{rank}' in the path every rank writes")
    p.add_argument("--save-params", help="rank 0 saves the final parameters here (torch.save)")
    args = p.parse_args(argv)
    for key, value in DEFAULTS[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.framework_by_default = args.framework is None   # rank 0's first line says so
    if args.framework is None:   # torchrun starts torch.distributed workers: DDP is their data parallelism
        args.framework = "ddp" if detect_launcher(env)[0] == "torch" else "horovod"
    elif (why := launch_error(args.framework, env)) is not None:
        p.error(why)
    if args.compression in SPARSE_MODES:
        args.sparse_embeddings = True
    if args.compression not in SUPPORTED[args.framework]:
        p.error(f"--framework {args.framework} does not implement --compression {args.compression} "
                f"(it implements {', '.join(SUPPORTED[args.framework])})")
    if args.thc_exact != "none" and (args.framework, args.compression) != ("ddp", "thc"):
        p.error(f"--thc-exact {args.thc_exact} is an option of --framework ddp --compression thc (THCHookState's "
                f"exact=), got --framework {args.framework} --compression {args.compression}")
    if args.framework == "fsdp" and args.sparse_embeddings:
        p.error("--framework fsdp takes dense embeddings only: drop --sparse-embeddings")
    # Horovod densifies sparse gradients (sparse_as_dense) for every mode but its own sparse allreduce
    sparse_grads = args.sparse_embeddings and (args.framework != "horovod" or args.compression == "sparse")
    if sparse_grads and args.optimizer == "adam":
        p.error(f"--compression {args.compression} leaves the embeddings' gradients sparse, which torch's Adam "
                f"refuses: add --optimizer sgd (--model {args.model} defaults to adam)")
    if args.warmup >= args.steps:
        p.error(f"--warmup must be in [0, steps={args.steps}), got {args.warmup}")
    if args.shards is not None:
        world = env.get("WORLD_SIZE") if detect_launcher(env)[0] == "torch" else None
        if args.framework != "fsdp":
            p.error(f"--shards is an option of --framework fsdp (got --framework {args.framework})")
        if world is not None and int(world) % args.shards:
            p.error(f"--shards {args.shards} must divide the world size {world}")
    launched = detect_launcher(env)[0] == "torch" and env.get("WORLD_SIZE")
    why = fsdp_refusal(args, int(launched) if launched else None)
    if why:
        p.error(why)
    if args.device == "cuda" and local_rank(env) >= torch.cuda.device_count():
        p.error(f"--device cuda: local rank {local_rank(env)} has no GPU of its own (this machine has "
                f"{torch.cuda.device_count()}): start at most that many workers per machine")
    return args


def output_layer_parameters(model) -> list:
    """The parameters of every ``nn.Linear`` whose outputs are a vocabulary (as many as some
    ``nn.Embedding``'s rows): the tensors THC must not carry under Adam (docs/THC.md)."""
    sizes = {m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    heads = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.out_features in sizes]
    return [p for m in heads for p in m.parameters()]


def dense_grad_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def main(argv=None, default_model="ncf") -> dict:
    args = parse_args(argv, default_model)
    if args.device == "cuda":
        torch.cuda.set_device(local_rank(os.environ))
    fw = FRAMEWORKS[args.framework](args)
    # Leave each rank its share of the cores: oversubscribed intra-op threads swamp step times.
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // fw.size))
    torch.manual_seed(args.seed)
    work = WORKLOADS[args.model](args, fw.rank)
    dtype = getattr(torch, args.dtype)
    model = work.model.to(args.device, dtype)

    def evaluate() -> float:  # the data sets live on the CPU, in float32
        if args.device == "cpu" and dtype == torch.float32:
            return work.evaluate(model)
        return work.evaluate(copy.deepcopy(model).cpu().float())
    opt = OPTIMIZERS[args.optimizer](model.parameters(), args.lr)
    wrapped, opt = fw.wrap(model, opt, args)
    say = print if fw.rank == 0 else (lambda *a, **k: None)
    dense_bytes = dense_grad_bytes(model)
    default = ""
    if getattr(args, "framework_by_default", False):
        default = f" (--framework's default under {detect_launcher(os.environ)[1] or 'no launcher'})"
    say(f"{args.model} on {fw.size} {args.framework} worker(s){default}, "
        f"compression={args.compression}: "
        f"{sum(p.numel() for p in model.parameters()):,} parameters, {dense_bytes / 2**20:.1f} MiB of gradients "
        f"per step; {work.metric} before training {evaluate():.4f}")

    step_times, losses = [], []
    window_start = {"stats": fw.stats(), "net": None}  # the timed window starts after the warm-up

    def start_window():
        fw.barrier()  # every rank has finished the warm-up, its traffic included
        window_start["stats"] = fw.stats()
        window_start["net"] = interface_bytes(args.net_iface) if args.net_iface else None
    if args.warmup == 0:
        start_window()
    for step in range(1, args.steps + 1):
        batch = tuple(t.to(args.device, dtype) if t.is_floating_point() else t.to(args.device)
                      for t in next(work.batches))
        t0 = time.perf_counter()
        opt.zero_grad()  # set_to_none=True, torch 2.x default (Horovod 0.28 takes no arguments)
        loss = work.loss(wrapped, batch)
        loss.backward()
        opt.step()
        if args.sparse_embeddings:
            coalesce_sparse_state(opt)
        step_times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        if step == args.warmup:
            start_window()
        if step % args.log_every == 0 or step == args.steps:
            say(f"step {step:5d}  loss {statistics.fmean(losses[-args.log_every:]):.4f}  "
                f"step {1e3 * statistics.median(step_times[-args.log_every:]):.1f} ms")

    fw.barrier()  # the last step's traffic has left every rank before the counters are read
    net = None
    if args.net_iface:
        end = interface_bytes(args.net_iface)
        net = {k: end[k] - window_start["net"][k] for k in end}
    timed = args.steps - args.warmup
    stats = stats_delta(fw.stats(), window_start["stats"])
    sent = {"none": dense_bytes, "fp16": dense_bytes * 2 / dtype.itemsize,
            "bf16": dense_bytes * 2 / dtype.itemsize}.get(args.compression)
    if sent is None:
        sent = stats["payload_bytes"] / timed if stats else float("nan")
    result = {
        "model": args.model, "framework": args.framework, "compression": args.compression,
        "workers": fw.size, "steps": args.steps, "final_loss": statistics.fmean(losses[-10:]),
        "metric": work.metric, "value": evaluate(),
        "bytes_per_step": sent, "dense_bytes_per_step": dense_bytes,
        "step_ms_median": 1e3 * statistics.median(step_times[args.warmup:] if args.warmup else
                                                   (step_times[1:] or step_times)),
        "fallbacks": stats["fallbacks"] if stats else 0, "stats": stats,
        "rank": fw.rank, "warmup": args.warmup, "timed_steps": timed,
        "step_seconds": step_times[args.warmup:], "net_bytes": net,
    }
    if sent != sent:   # NaN: the mode's bytes are not counted here (the engine's own sparse path, PowerSGD)
        wire = "sent: not counted for this mode"
    elif args.framework == "fsdp" and stats and args.compression not in ("none", "fp16", "bf16"):
        # the hooks carry one phase (the replica all-reduce of a shard, or the reduce-scatter): against the
        # dense bytes of what they carried, not the whole model's
        wire = f"sent {sent / 2**20:.2f} MiB per step ({stats['wire_ratio']:.3f} of dense, in the compressed phase)"
    else:
        wire = f"sent {sent / 2**20:.2f} MiB per step ({sent / dense_bytes:.3f} of dense)"
    say(f"{work.metric} {result['value']:.4f}; {wire}; median step {result['step_ms_median']:.1f} ms; "
        f"fallbacks {result['fallbacks']}")
    if args.json and (fw.rank == 0 or "{rank}" in args.json):
        with open(args.json.format(rank=fw.rank), "w") as f:
            json.dump(result, f, indent=2)
    if args.save_params:
        full = getattr(fw, "full_state_dict", None)   # FSDP: gathering the shards is a collective
        params = full(model) if full else {k: v.detach().clone() for k, v in model.state_dict().items()}
        if fw.rank == 0:
            torch.save(params, args.save_params)
    fw.shutdown()
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
    leave()
