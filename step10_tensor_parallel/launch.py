"""起进程、收进程：本进程成为 rank 0，其余 tp × pp − 1 个 rank 跑 worker_main（默认 model_runner.serve_worker）。
通信本身（进程组、集合通信、心跳、出错时整组停下）在 distributed.py。三种启动方式走同一条路（launch）：

    python step10_tensor_parallel/run.py --tp 2 --pp 2 ...        run.py 自己用 torch.multiprocessing（forkserver）起 3 个
                                                                 worker，本进程是 rank 0；只连 127.0.0.1
    torchrun --nproc-per-node 3 step10_tensor_parallel/run.py --tp 3 ...           torchrun 起 3 个进程，各自读环境变量
    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0|1 --rdzv-endpoint 127.0.0.1:PORT run.py --tp 2 --pp 2 ...
                                                                 两个"节点"（这里是同一台机器上的两个 torchrun）

rank 0 跑引擎（调度器、块管理器、采样）；其余 rank 只跑 serve_worker：按 rank 0 发来的配置建 ModelRunner，
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
"""
import os
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing.connection import wait

from common.errors import UserError

from .distributed import COMM_TIMEOUT, IDLE_TIMEOUT, CommError, ParallelContext, WorkerFailed
from .model_runner import serve_worker

ROOT_CAUSE_WAIT = 3.0                            # rank 0 通信失败后，等出错的 worker 把原因写进 store 的时间
PRELOAD = ("common.cli",)                        # 每个 run.py 顶部都 import 它（带进 transformers）：forkserver 先 import 好


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


def _init(rank: int, tp: int, pp: int, store, timeout, idle_timeout) -> ParallelContext:
    dist.init_process_group("gloo", store=store, rank=rank, world_size=tp * pp, timeout=idle_timeout)
    return ParallelContext(rank, tp, pp, store, timeout, idle_timeout)


def _report(store, rank: int, e: BaseException) -> None:
    """把一行错误写进 store：errors 计数器给出先后，rank 0 取最先的那个（它是原因，后面的多半是后果）。"""
    msg = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
    msg = f"rank {rank}: {' '.join(msg.split())}"
    try:
        n = store.add("errors", 1)
        store.set(f"error/{n}", msg)
    except Exception:   # store 本身也没了（rank 0 已经退出）：没有人可以告诉了
        pass


def _serve(rank: int, tp: int, pp: int, store, timeout, idle_timeout, worker_main: Callable,
           worker_args: tuple) -> int:
    """worker 进程（spawn 或 torchrun 起的）的主体，返回退出码。"""
    try:
        parallel = _init(rank, tp, pp, store, timeout, idle_timeout)
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


def _child(rank: int, tp: int, pp: int, port: int, timeout, idle_timeout, threads: int, ifname: str, worker_main,
           worker_args):
    """torch.multiprocessing 起的 worker 进程的入口。"""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C 只交给 rank 0：由它收掉整个组
    _watch_parent()
    os.environ["GLOO_SOCKET_IFNAME"] = ifname      # gloo 只在回环网卡上连
    torch.set_num_threads(threads)
    code = 2
    try:
        store = dist.TCPStore("127.0.0.1", port, tp * pp, is_master=False, timeout=timeout)
        store.set(f"up/{rank}", "1")
        code = _serve(rank, tp, pp, store, timeout, idle_timeout, worker_main, worker_args)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)   # 不跑 atexit、不析构进程组：对面可能已经没了，析构时还可能等它


def _reported(store) -> Optional[str]:
    """最先报告的 worker 错误（没有就是 None）。"""
    try:
        return store.get("error/1").decode() if store.check(["error/1"]) else None
    except Exception:   # store 本身也没了
        return None


def _exited(procs) -> Optional[str]:
    """已经退出的子进程（spawn 起的；torchrun 起的不是本进程的子进程，看不到）。"""
    dead = [f"rank {i + 1} exited with code {p.exitcode}" for i, p in enumerate(procs) if p.exitcode is not None]
    return ", ".join(dead) or None


def _root_cause(store, procs, e: CommError) -> str:
    """rank 0 的通信失败了：等一会儿，取最先报告的 worker 错误；没有人报告（被 kill 了）就说是哪个进程没了。"""
    deadline = time.monotonic() + ROOT_CAUSE_WAIT
    while time.monotonic() < deadline:
        if (why := _reported(store)) is not None:
            return why
        time.sleep(0.05)
    return (_exited(procs) or "a worker process stopped answering") + f" ({e})"


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
           threads: Optional[int] = None, timeout=COMM_TIMEOUT, idle_timeout=IDLE_TIMEOUT,
           preload: tuple[str, ...] = PRELOAD) -> Iterator[ParallelContext]:
    """进入时：本进程成为 rank 0，其余 tp·pp − 1 个 rank 跑 worker_main(parallel, *worker_args)。
    - torchrun 起的（环境变量里有 RANK、WORLD_SIZE）：每个进程都走到这里；rank ≠ 0 就地跑 worker_main，然后退出进程。
    - 否则 tp·pp > 1 时用 torch.multiprocessing（forkserver，没有时 spawn）起子进程；tp·pp = 1 时什么也不起
      （一个进程，与 step09 相同）。
    timeout：层里一次通信最多等多久；idle_timeout：worker 等 rank 0 的下一条消息最多等多久（rank 0 空闲时有心跳，
    见 distributed.py；测试里把它缩短到几秒）。
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
            code = _serve(rank, tp, pp, store, timeout, idle_timeout, worker_main, worker_args)
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
        procs = [start.Process(target=_child, args=(r, tp, pp, store.port, timeout, idle_timeout, threads, ifname,
                                                  worker_main, worker_args), daemon=True) for r in range(1, world)]
        for p in procs:
            p.start()
        torch.set_num_threads(threads)             # rank 0 与每个 worker 一样多的线程
    ok, parallel = False, None
    try:
        if procs:
            _wait_for_workers(store, procs, world)
        parallel = _init(0, tp, pp, store, timeout, idle_timeout)
        parallel.root_cause = lambda e: _root_cause(store, procs, e)
        parallel.lost_worker = lambda: _reported(store) or _exited(procs)
        yield parallel
        parallel.shutdown()              # 出过错的组什么也不发：错误已经在出错的那一步抛出过了
        ok = parallel.failure is None
    finally:
        if parallel is not None:
            parallel.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
        _reap(procs, graceful=ok)
        torch.set_num_threads(threads_before)

