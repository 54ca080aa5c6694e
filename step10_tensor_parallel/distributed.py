"""进程、进程组与通信（torch.distributed，gloo 后端：CPU 上的集合通信）。

一个模型跑在 world = tp × pp 个进程上，rank = pp_rank · tp + tp_rank（TP 是最内层：一个 stage 的 TP 组是相邻的
rank，torchrun 的一个"节点"正好是一个 stage）。三种启动方式走同一条路：

    python step10_tensor_parallel/run.py --tp 2 --pp 2 ...        run.py 自己用 torch.multiprocessing（spawn）起 3 个 worker，
                                                                 本进程是 rank 0；只连 127.0.0.1
    torchrun --nproc-per-node 3 step10_tensor_parallel/run.py --tp 3 ...           torchrun 起 3 个进程，各自读环境变量
    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0|1 --rdzv-endpoint 127.0.0.1:PORT run.py --tp 2 --pp 2 ...
                                                                 两个"节点"（这里是同一台机器上的两个 torchrun）

rank 0 跑引擎（调度器、块管理器、采样）；其余 rank 只跑 serve_worker：按 rank 0 发来的配置建同样的引擎，
每一步收计划、跑自己那一份前向。

进程一个不剩地收掉（launch 的 finally）：
- 正常结束：rank 0 发"停"，worker 自己退出。
- rank 0 出错（坏输入、Ctrl-C、bug）：不再做任何集合通信（worker 可能正停在某次 all-reduce 里，这时再发一条"停"
  会和它配错对），直接拆掉进程组；worker 的下一次（或正在等的）通信因为连接断开而失败，安静地退出；
  0.5 秒后还活着的子进程被 terminate。
- 某个 worker 出错：它把一行错误写进 TCPStore（所有 rank 共用的键值存储），然后退出；其余 rank 的通信因为
  连接断开而失败（CommError：不是原因，只是后果），rank 0 从 store 里取出最先报告的那一行，作为一行 `error:`
  报出来（WorkerFailed 是 UserError：退出码 2）。
- 父进程被 kill -9：spawn 的子进程有一个看门狗线程，发现父进程换了就退出；连接断开也会让它们的通信失败。
- 挂住的通信：层里的通信组超时 COMM_TIMEOUT 就抛错；等下一步计划的 broadcast 用默认组（IDLE_TIMEOUT：rank 0
  在两步之间可以空闲很久，例如章节模式在跑参考引擎）。
"""
import datetime
import os
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing.connection import wait

from common.errors import UserError

from .engine import LLMEngine
from .parallel_layers import load_shard

COMM_TIMEOUT = datetime.timedelta(seconds=120)   # 一次层内通信最多等多久（等最慢的 rank 算完一个子层）
IDLE_TIMEOUT = datetime.timedelta(minutes=30)    # worker 等下一步计划最多等多久
ROOT_CAUSE_WAIT = 3.0                            # rank 0 通信失败后，等出错的 worker 把原因写进 store 的时间
END = -1                                         # 计划缓冲区的第一个数是 END：这个引擎结束了（step_message.py）
PRELOAD = ("common.cli",)                        # 每个 run.py 顶部都 import 它（带进 transformers）：forkserver 先 import 好


class CommError(RuntimeError):
    """一次通信失败：对面的进程没了（连接断开）或超时。它是后果，不是原因。"""


class WorkerFailed(UserError):
    """某个 rank 出错了：整组停下，rank 0 把最先报告的原因作为一行 `error:` 报出来（退出码 2）。"""


FORWARD_OPS = ("all_reduce", "gather", "send", "recv")   # 前向里的通信（计划的 broadcast 在前向之外，另算）


@dataclass
class CommStats:
    """本 rank 的通信与计算账：每种操作的次数、字节（本 rank 交出去的张量大小）、秒数。"""
    ops: dict[str, list] = field(default_factory=dict)   # 操作名 → [次数, 字节, 秒]

    def add(self, op: str, nbytes: int, seconds: float) -> None:
        c = self.ops.setdefault(op, [0, 0, 0.0])
        c[0] += 1
        c[1] += nbytes
        c[2] += seconds

    def snapshot(self) -> dict[str, list]:
        return {k: list(v) for k, v in self.ops.items()}


def forward_comm_seconds(ops: dict[str, list]) -> float:
    """一个 rank 的前向里花在通信上的秒数（包括等别的 rank 算到同一处的时间）。"""
    return sum(ops[k][2] for k in FORWARD_OPS if k in ops)


@contextmanager
def _comm(stats: CommStats, op: str, nbytes: int):
    """记一次通信的账；通信里抛的错换成 CommError（对面挂了），与本 rank 自己的错区分开。"""
    t0 = time.perf_counter()
    try:
        yield
    except RuntimeError as e:
        raise CommError(" ".join(str(e).split())[:300]) from None
    stats.add(op, nbytes, time.perf_counter() - t0)


class Group:
    """一组 rank（一个 stage 的 TP 组）上的集合通信。只有一个 rank 时什么也不做（tp = 1 与 step09 逐位相同）。"""

    def __init__(self, ranks: list[int], pg, rank: int, stats: CommStats):
        self.ranks, self.pg, self.stats = ranks, pg, stats
        self.size, self.first = len(ranks), ranks[0]
        self.is_first = rank == ranks[0]

    def all_reduce(self, x: torch.Tensor) -> None:
        """原地求和：每个 rank 的 x 都变成组里所有 x 的和。"""
        if self.size == 1:
            return
        with _comm(self.stats, "all_reduce", x.nbytes):
            dist.all_reduce(x, group=self.pg)

    def gather(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """组里每个 rank 的 x (…, n) 沿最后一维拼到第一个 rank 上：(…, size·n)；其他 rank 返回 None。"""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in self.ranks] if self.is_first else None
        with _comm(self.stats, "gather", x.nbytes):
            dist.gather(x, parts, dst=self.first, group=self.pg)
        return torch.cat(parts, dim=-1) if self.is_first else None


class ParallelContext:
    """本进程在并行里的位置，以及它要用的全部通信。模型的层（parallel_layers.py）与引擎只通过它通信。"""

    def __init__(self, rank: int, tp_size: int, pp_size: int, store=None, timeout=COMM_TIMEOUT):
        self.rank, self.tp_size, self.pp_size = rank, tp_size, pp_size
        self.world_size = tp_size * pp_size
        self.tp_rank, self.pp_rank = rank % tp_size, rank // tp_size
        self.store, self.stats = store, CommStats()
        self.plan_numel: Optional[int] = None    # 当前这个引擎的计划缓冲区有多大（None = 没有打开的引擎）
        self.p2p = None
        stage = list(range(self.pp_rank * tp_size, (self.pp_rank + 1) * tp_size))
        if self.world_size == 1:
            self.tp_group = Group(stage, None, rank, self.stats)
            return
        # 每个 rank 都要按同样的顺序创建每一个组（也包括自己不在的组）
        for s in range(pp_size):
            ranks = list(range(s * tp_size, (s + 1) * tp_size))
            pg = dist.new_group(ranks, timeout=timeout, backend="gloo") if tp_size > 1 else None
            if s == self.pp_rank:
                self.tp_group = Group(ranks, pg, rank, self.stats)
        if pp_size > 1:
            self.p2p = dist.new_group(list(range(self.world_size)), timeout=timeout, backend="gloo")

    @classmethod
    def single(cls) -> "ParallelContext":
        return cls(0, 1, 1)

    # ---- 流水线：stage 之间只传 hidden states，最后一个 stage 把 logits 发回 rank 0 ----
    def send_hidden(self, x: torch.Tensor) -> None:
        with _comm(self.stats, "send", x.nbytes):
            dist.send(x.contiguous(), self.rank + self.tp_size, group=self.p2p)   # 下一个 stage 的同一个 tp_rank

    def recv_hidden(self, shape, dtype) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype)
        with _comm(self.stats, "recv", x.nbytes):
            dist.recv(x, self.rank - self.tp_size, group=self.p2p)
        return x

    def send_logits(self, logits: torch.Tensor) -> None:
        with _comm(self.stats, "send", logits.nbytes):
            dist.send(logits.contiguous(), 0, group=self.p2p)

    def recv_logits(self, shape) -> torch.Tensor:
        x = torch.empty(shape, dtype=torch.float32)
        with _comm(self.stats, "recv", x.nbytes):
            dist.recv(x, (self.pp_size - 1) * self.tp_size, group=self.p2p)
        return x

    # ---- rank 0 → 所有 rank：引擎配置（偶尔，pickle）与每一步的计划（每步一次 broadcast，定长的 int32 缓冲区）----
    def broadcast_object(self, obj=None):
        """rank 0 发 obj，其他 rank 收到并返回它（broadcast_object_list：pickle 之后两次 broadcast，先长度后内容）。"""
        box = [obj]
        with _comm(self.stats, "broadcast_object", 0):
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def open_engine(self, config, plan_numel: int) -> None:
        """一个引擎开始：rank 0 把配置发给其他 rank（它们按同一份配置建引擎）；每个 rank 记下计划缓冲区多大。"""
        if self.rank == 0:
            self.broadcast_object(config)
        self.plan_numel = plan_numel

    def broadcast_plan(self, plan: Optional[torch.Tensor] = None) -> torch.Tensor:
        """rank 0 发这一步的计划，其他 rank 收。接收方要事先知道收多少个数：集合通信不带形状，所以缓冲区定长。"""
        buf = plan if self.rank == 0 else torch.empty(self.plan_numel, dtype=torch.int32)
        with _comm(self.stats, "broadcast", buf.nbytes):
            dist.broadcast(buf, src=0)
        return buf

    def close_engine(self) -> list[dict]:
        """rank 0：发 END（worker 离开这个引擎的循环），然后收集每个 rank 的通信账（按 rank 排）。所有 rank 都调用。"""
        if self.rank == 0:
            self.broadcast_plan(torch.full((self.plan_numel,), END, dtype=torch.int32))
        self.plan_numel = None
        stats, self.stats.ops = self.stats.snapshot(), {}
        if self.world_size == 1:
            return [stats]
        out = [None] * self.world_size if self.rank == 0 else None
        with _comm(CommStats(), "gather_object", 0):
            dist.gather_object(stats, out, dst=0)
        return out

    def shutdown(self) -> None:
        """rank 0：还开着的引擎先结束，再发 None（worker 退出）。"""
        if self.plan_numel is not None:
            self.close_engine()
        self.broadcast_object(None)


def serve_worker(parallel: ParallelContext, model_dir, device: str, dtype: torch.dtype, linear: str = "auto") -> None:
    """rank ≠ 0 的全部工作：装上自己那一份模型；rank 0 每建一个引擎，就按同一份配置建一个，跑到它结束。"""
    model = load_shard(model_dir, parallel, device, dtype, linear)
    while (config := parallel.broadcast_object()) is not None:
        # 猜测只在 rank 0 上做（草稿模型也只在那里）：要验证的猜测已经写在每一步的计划里
        LLMEngine(model, replace(config, spec_method="none"), parallel=parallel).run_worker()


# ---------------------------------------------------------------- 启动与收尾

def _start_method(preload: tuple[str, ...]):
    """forkserver：一个干净的服务进程先 import 一次 torch、这个文件和 preload（主程序顶部 import 的模块），之后每个
    worker 从它 fork 出来——worker 照例重新执行一遍主程序（multiprocessing 总是这样做），但它要的模块都已经在了，
    不用每个 worker 再花几秒 import；也不是从已经起了 OpenMP 线程的 rank 0 直接 fork。没有 forkserver 的平台
    （Windows）用 spawn：每个 worker 一个全新的解释器，各自 import 一遍。"""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", __name__, *preload])   # 服务进程第一次启动时才用得上
    return ctx


def _loopback_ifname() -> str:
    """回环网卡的名字（Linux 是 lo，macOS 是 lo0）：gloo 只在 127.0.0.1 上连。"""
    return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), "lo")


def _init(rank: int, tp: int, pp: int, store, timeout) -> ParallelContext:
    dist.init_process_group("gloo", store=store, rank=rank, world_size=tp * pp, timeout=IDLE_TIMEOUT)
    return ParallelContext(rank, tp, pp, store, timeout)


def _report(store, rank: int, e: BaseException) -> None:
    """把一行错误写进 store：errors 计数器给出先后，rank 0 取最先的那个（它是原因，后面的多半是后果）。"""
    msg = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
    msg = f"rank {rank}: {' '.join(msg.split())}"
    try:
        n = store.add("errors", 1)
        store.set(f"error/{n}", msg)
    except Exception:   # store 本身也没了（rank 0 已经退出）：没有人可以告诉了
        pass


def _serve(rank: int, tp: int, pp: int, store, timeout, worker_main: Callable, worker_args: tuple) -> int:
    """worker 进程（spawn 或 torchrun 起的）的主体，返回退出码。"""
    try:
        parallel = _init(rank, tp, pp, store, timeout)
        worker_main(parallel, *worker_args)
        return 0
    except CommError:          # 别的 rank 先出了错（或 rank 0 拆掉了进程组）：原因由它报告，这里安静地退出
        return 1
    except KeyboardInterrupt:
        return 130
    except BaseException as e:
        _report(store, rank, e)
        return 2


def _watch_parent() -> None:
    """父进程（rank 0）没了就退出：即使它是被 kill -9 的、来不及收尾，也不留下孤儿进程。"""
    parent = mp.parent_process()

    def loop():
        wait([parent.sentinel])   # 父进程退出时这个句柄变为可读
        os._exit(1)
    threading.Thread(target=loop, daemon=True).start()


def _child(rank: int, tp: int, pp: int, port: int, timeout, threads: int, ifname: str, worker_main, worker_args):
    """torch.multiprocessing 起的 worker 进程的入口。"""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C 只交给 rank 0：由它收掉整个组
    _watch_parent()
    os.environ["GLOO_SOCKET_IFNAME"] = ifname      # gloo 只在回环网卡上连
    torch.set_num_threads(threads)
    code = 2
    try:
        store = dist.TCPStore("127.0.0.1", port, tp * pp, is_master=False, timeout=timeout)
        store.set(f"up/{rank}", "1")
        code = _serve(rank, tp, pp, store, timeout, worker_main, worker_args)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)   # 不跑 atexit、不析构进程组：对面可能已经没了，析构时还可能等它


def _root_cause(store, procs, e: CommError) -> str:
    """rank 0 的通信失败了：等一会儿，取最先报告的 worker 错误；没有人报告（被 kill 了）就说是哪个进程没了。"""
    deadline = time.monotonic() + ROOT_CAUSE_WAIT
    while time.monotonic() < deadline:
        try:
            if store.check(["error/1"]):
                return store.get("error/1").decode()
        except Exception:
            break
        time.sleep(0.05)
    dead = [f"rank {i + 1} exited with code {p.exitcode}" for i, p in enumerate(procs) if p.exitcode is not None]
    return (", ".join(dead) if dead else "a worker process stopped answering") + f" ({e})"


def _wait_for_workers(store, procs, world: int) -> None:
    """spawn 的子进程都连上了 store 才开始建进程组；有谁没起来就报错，而不是在建组时一直等下去。"""
    keys = [f"up/{r}" for r in range(1, world)]
    while not store.check(keys):
        if store.check(["error/1"]):
            raise WorkerFailed(store.get("error/1").decode())
        for i, p in enumerate(procs):
            if p.exitcode is not None:
                raise WorkerFailed(f"rank {i + 1} exited with code {p.exitcode} before joining the group")
        time.sleep(0.02)


def _reap(procs, graceful: bool) -> None:
    """等子进程退出；正常结束给它们 10 秒，出错时 0.5 秒（连接断开后它们自己就退出了，还在的多半停在一次
    再也等不到的通信里），之后 terminate，再不退就 kill。"""
    deadline = time.monotonic() + (10.0 if graceful else 0.5)
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join()


@contextmanager
def launch(tp: int, pp: int, worker_main: Callable = serve_worker, worker_args: tuple = (),
           threads: Optional[int] = None, timeout=COMM_TIMEOUT, preload: tuple[str, ...] = PRELOAD
           ) -> Iterator[ParallelContext]:
    """进入时：本进程成为 rank 0，其余 tp·pp − 1 个 rank 跑 worker_main(parallel, *worker_args)。
    - torchrun 起的（环境变量里有 RANK、WORLD_SIZE）：每个进程都走到这里；rank ≠ 0 就地跑 worker_main，然后退出进程。
    - 否则 tp·pp > 1 时用 torch.multiprocessing（forkserver，没有时 spawn）起子进程；tp·pp = 1 时什么也不起
      （一个进程，与 step09 相同）。
    退出时（正常、出错、Ctrl-C）：见文件开头"进程一个不剩地收掉"。"""
    world, procs, threads_before = tp * pp, [], torch.get_num_threads()
    threads = threads or max(1, (os.cpu_count() or 1) // world)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:       # torchrun
        if int(os.environ["WORLD_SIZE"]) != world:
            raise UserError(f"torchrun started {os.environ['WORLD_SIZE']} processes but --tp {tp} x --pp {pp} "
                            f"needs {world}")
        rank = int(os.environ["RANK"])
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"   # torchrun 的 agent 已经开了 store
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=rank == 0 and not agent_store, timeout=timeout)
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", threads)))
        if rank != 0:
            code = _serve(rank, tp, pp, store, timeout, worker_main, worker_args)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    elif world == 1:
        yield ParallelContext.single()
        return
    else:
        ifname = os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_ifname())
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        start = _start_method(preload)
        procs = [start.Process(target=_child, args=(r, tp, pp, store.port, timeout, threads, ifname, worker_main,
                                                  worker_args), daemon=True) for r in range(1, world)]
        for p in procs:
            p.start()
        torch.set_num_threads(threads)             # rank 0 与每个 worker 一样多的线程
    ok = False
    try:
        if procs:
            _wait_for_workers(store, procs, world)
        parallel = _init(0, tp, pp, store, timeout)
        try:
            yield parallel
            parallel.shutdown()
            ok = True
        except CommError as e:
            raise WorkerFailed(_root_cause(store, procs, e)) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        _reap(procs, graceful=ok)
        torch.set_num_threads(threads_before)

