"""进程组与通信（torch.distributed，gloo 后端：CPU 上的集合通信）：一个 rank 在并行里的位置（Layout），以及它要用的
全部通信（ParallelContext）。进程怎么起、怎么收：launch.py；worker 跑什么：model_runner.py。

一个模型跑在 world = tp × pp 个进程上，rank = pp_rank · tp + tp_rank（TP 是最内层：一个 stage 的 TP 组是相邻的
rank，torchrun 的一个"节点"正好是一个 stage）。三种通信：

    一个 stage 的 TP 组   相邻的 tp 个 rank   层里的 all-reduce（行切层、embedding）与 gather（logits 拼到 rank 0）
    p2p（pp > 1）         全部 rank           stage 之间 send / recv hidden；最后一个 stage 把 logits 发回 rank 0
    默认组                全部 rank           rank 0 → 所有 rank：引擎配置（偶尔，pickle）与每一步的计划（step_message.py）

出错：任何一次通信失败（对面的进程没了、超时），这一组就停了。worker 抛 CommError（它是后果，不是原因：安静地退出）；
rank 0 找出原因（launch 给的 root_cause：store 里最先报告的那一行、退出了的子进程），记在 failure，抛 WorkerFailed
（UserError：run.py 打印成一行 `error:`，退出码 2）。发现它的那次 step() 抛出它，之后不再通信：close() 与收尾不因
worker 出错而抛错（活已经干完了，退出时不该有 traceback）。服务器的 /health 调用 LLMEngine.worker_failure()：不通信、
不阻塞，看记下的失败，以及有没有 worker 报告了错误或者退出了（launch 给的 lost_worker）。

超时：层里的组 COMM_TIMEOUT（等最慢的 rank 算完一个子层）；默认组 IDLE_TIMEOUT（worker 等 rank 0 的下一条消息）。
rank 0 在两步之间可以空闲任意久（服务器没有请求、章节模式在跑参考引擎）：它有一个心跳线程，默认组上 IDLE_TIMEOUT / 4
没发过东西就发一个心跳（HEARTBEAT），worker 收到就接着等——所以 worker 永远等得到下一条消息。
"""
import datetime
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from common.errors import UserError

from .step_message import END, HEARTBEAT

COMM_TIMEOUT = datetime.timedelta(seconds=120)   # 一次层内通信最多等多久（等最慢的 rank 算完一个子层）
IDLE_TIMEOUT = datetime.timedelta(minutes=30)    # worker 等 rank 0 的下一条消息最多等多久（rank 0 空闲时有心跳）
STOP_WAIT = 3.0                                  # 收尾时最多等一个正在发的心跳几秒


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


class Group:
    """一组 rank（一个 stage 的 TP 组）上的集合通信。只有一个 rank 时什么也不做（tp = 1 与 step09 逐位相同）。"""

    def __init__(self, ranks: list[int], pg, parallel: "ParallelContext"):
        self.ranks, self.pg, self.parallel = ranks, pg, parallel
        self.size, self.first = len(ranks), ranks[0]
        self.is_first = parallel.rank == ranks[0]

    def all_reduce(self, x: torch.Tensor) -> None:
        """原地求和：每个 rank 的 x 都变成组里所有 x 的和。"""
        if self.size == 1:
            return
        with self.parallel.comm("all_reduce", x.nbytes):
            dist.all_reduce(x, group=self.pg)

    def gather(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """组里每个 rank 的 x (…, n) 沿最后一维拼到第一个 rank 上：(…, size·n)；其他 rank 返回 None。"""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in self.ranks] if self.is_first else None
        with self.parallel.comm("gather", x.nbytes):
            dist.gather(x, parts, dst=self.first, group=self.pg)
        return torch.cat(parts, dim=-1) if self.is_first else None


class Layout:
    """一个 rank 在 tp × pp 里的位置。只有位置、不通信：parallel_layers 的 Shard.of 从这里取 tp_rank / pp_rank；
    不起进程时（数每个 rank 存多少、测试里拼回切片）直接用它装切片——tp_group 是 None，这样的模型只装权重、不跑前向。"""
    tp_group = None

    def __init__(self, rank: int, tp_size: int, pp_size: int):
        self.rank, self.tp_size, self.pp_size = rank, tp_size, pp_size
        self.world_size = tp_size * pp_size
        self.tp_rank, self.pp_rank = rank % tp_size, rank // tp_size   # TP 是最内层


class ParallelContext(Layout):
    """本进程在并行里的位置，以及它要用的全部通信。模型的层（parallel_layers.py）与引擎只通过它通信。"""

    def __init__(self, rank: int, tp_size: int, pp_size: int, store=None, timeout=COMM_TIMEOUT,
                 idle_timeout=IDLE_TIMEOUT):
        super().__init__(rank, tp_size, pp_size)
        self.store, self.stats = store, CommStats()
        self.plan_numel: Optional[int] = None    # 当前这个引擎的计划缓冲区有多大（None = 没有打开的引擎）
        self.p2p = None
        # rank 0：这一组因为什么停了（None = 还好好的）；launch 告诉它怎样找原因（store 里的报告、退出了的子进程）
        self.failure: Optional[WorkerFailed] = None
        self.root_cause: Callable[[CommError], str] = str
        self.lost_worker: Callable[[], Optional[str]] = lambda: None
        # rank 0 上默认组的发送一次只有一个线程在做（引擎的线程、心跳线程）
        self._lock, self._stopped, self._last_sent = threading.Lock(), threading.Event(), time.monotonic()
        stage = list(range(self.pp_rank * tp_size, (self.pp_rank + 1) * tp_size))
        if self.world_size == 1:
            self.tp_group = Group(stage, None, self)
            return
        # 每个 rank 都要按同样的顺序创建每一个组（也包括自己不在的组）
        for s in range(pp_size):
            ranks = list(range(s * tp_size, (s + 1) * tp_size))
            pg = dist.new_group(ranks, timeout=timeout, backend="gloo") if tp_size > 1 else None
            if s == self.pp_rank:
                self.tp_group = Group(ranks, pg, self)
        if pp_size > 1:
            self.p2p = dist.new_group(list(range(self.world_size)), timeout=timeout, backend="gloo")
        if rank == 0:
            threading.Thread(target=self._heartbeat, args=(idle_timeout.total_seconds() / 4,), daemon=True,
                             name="heartbeat").start()

    @classmethod
    def single(cls) -> "ParallelContext":
        return cls(0, 1, 1)

    @contextmanager
    def comm(self, op: str, nbytes: int, stats: Optional[CommStats] = None):
        """一次通信：记账（stats 默认是本 rank 的账）。通信里抛的错说明对面没了或超时，这一组从此停下：worker 抛
        CommError（它是后果，不是原因：安静地退出）；rank 0 找出原因，记在 failure 里，抛 WorkerFailed。"""
        if self.failure is not None:          # 已经停了：不再通信
            raise self.failure
        t0 = time.perf_counter()
        try:
            yield
        except RuntimeError as e:
            err = CommError(" ".join(str(e).split())[:300])
            if self.rank != 0:
                raise err from None
            self.failure = self.failure or WorkerFailed(self.root_cause(err))
            raise self.failure from None
        (self.stats if stats is None else stats).add(op, nbytes, time.perf_counter() - t0)

    # ---- 流水线：stage 之间只传 hidden states，最后一个 stage 把 logits 发回 rank 0 ----
    def send_hidden(self, x: torch.Tensor) -> None:
        with self.comm("send", x.nbytes):
            dist.send(x.contiguous(), self.rank + self.tp_size, group=self.p2p)   # 下一个 stage 的同一个 tp_rank

    def recv_hidden(self, shape, dtype) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype)
        with self.comm("recv", x.nbytes):
            dist.recv(x, self.rank - self.tp_size, group=self.p2p)
        return x

    def send_logits(self, logits: torch.Tensor) -> None:
        with self.comm("send", logits.nbytes):
            dist.send(logits.contiguous(), 0, group=self.p2p)

    def recv_logits(self, shape) -> torch.Tensor:
        x = torch.empty(shape, dtype=torch.float32)
        with self.comm("recv", x.nbytes):
            dist.recv(x, (self.pp_size - 1) * self.tp_size, group=self.p2p)
        return x

    # ---- rank 0 → 所有 rank：引擎配置（偶尔，pickle）与每一步的计划（每步一次 broadcast，定长的 int32 缓冲区）----
    # 这些都在默认组上。rank 0 发送时拿着 _lock（心跳线程也在这个组上发）；其他 rank 收到心跳就接着收下一条。
    def broadcast_object(self, obj=None):
        """rank 0 发 obj，其他 rank 收到并返回它（broadcast_object_list：pickle 之后两次 broadcast，先长度后内容）。"""
        if self.rank == 0:
            with self._lock:
                self._send_object(obj)
            return obj
        while True:
            box = [None]
            with self.comm("broadcast_object", 0):
                dist.broadcast_object_list(box, src=0)
            if not _is_heartbeat(box[0]):
                return box[0]

    def open_engine(self, config, plan_numel: int) -> None:
        """一个引擎开始：rank 0 把配置发给其他 rank（它们按同一份配置建 ModelRunner）；每个 rank 记下计划缓冲区多大。"""
        if self.rank == 0:
            with self._lock:
                self._send_object(config)
                self.plan_numel = plan_numel
        else:
            self.plan_numel = plan_numel

    def broadcast_plan(self, plan: Optional[torch.Tensor] = None) -> torch.Tensor:
        """rank 0 发这一步的计划，其他 rank 收。接收方要事先知道收多少个数：集合通信不带形状，所以缓冲区定长。"""
        if self.rank == 0:
            with self._lock:
                self._send_plan(plan)
            return plan
        buf = torch.empty(self.plan_numel, dtype=torch.int32)
        while True:
            with self.comm("broadcast", buf.nbytes):
                dist.broadcast(buf, src=0)
            if buf[0].item() != HEARTBEAT:
                return buf

    def close_engine(self) -> list[dict]:
        """rank 0：发 END（worker 离开这个引擎的循环），然后收集每个 rank 的通信账（按 rank 排）。所有 rank 都调用。
        rank 0 上它不因 worker 出错而抛错（活已经干完了，收尾时不该再有 traceback）：这一组已经停了、或者这时才发现
        某个 worker 没了，就什么也不发，返回 []。"""
        if self.rank != 0:
            return self._close_engine()
        with self._lock:
            if self.check_health() is None:
                try:
                    return self._close_engine()
                except WorkerFailed:
                    pass
            self.plan_numel = None
            return []

    def _close_engine(self) -> list[dict]:
        if self.rank == 0:
            self._send_plan(torch.full((self.plan_numel,), END, dtype=torch.int32))
        self.plan_numel = None
        stats, self.stats.ops = self.stats.snapshot(), {}
        if self.world_size == 1:
            return [stats]
        out = [None] * self.world_size if self.rank == 0 else None
        with self.comm("gather_object", 0, CommStats()):
            dist.gather_object(stats, out, dst=0)
        return out

    def shutdown(self) -> None:
        """rank 0：还开着的引擎先结束，再发 None（worker 退出）。与 close_engine 一样，worker 出过错就什么也不发、不抛错。"""
        if self.plan_numel is not None:
            self.close_engine()
        if self.check_health() is None:
            try:
                self.broadcast_object(None)
            except WorkerFailed:
                pass

    # ---- rank 0 的发送（调用者拿着 _lock）----
    def _send_object(self, obj, stats: Optional[CommStats] = None) -> None:
        with self.comm("broadcast_object", 0, stats):
            dist.broadcast_object_list([obj], src=0)
        self._last_sent = time.monotonic()

    def _send_plan(self, plan: torch.Tensor, stats: Optional[CommStats] = None) -> None:
        with self.comm("broadcast", plan.nbytes, stats):
            dist.broadcast(plan, src=0)
        self._last_sent = time.monotonic()

    # ---- rank 0：心跳与健康 ----
    def _heartbeat(self, every: float) -> None:
        """后台线程：默认组上 every 秒没发过东西（rank 0 空闲），就发一个心跳，不记账。发不出去（某个 worker 没了）
        就把原因记进 failure，线程结束；下一次 step() 抛出它，/health 也看得到。"""
        while not self._stopped.wait(every / 2):
            if time.monotonic() - self._last_sent < every:
                continue
            with self._lock:
                if self._stopped.is_set() or self.failure is not None:
                    return
                try:
                    if self.plan_numel is not None:    # worker 在某个引擎的循环里等计划
                        self._send_plan(torch.full((self.plan_numel,), HEARTBEAT, dtype=torch.int32), CommStats())
                    else:                              # worker 在等下一个引擎的配置
                        self._send_object(HEARTBEAT, CommStats())
                except WorkerFailed:
                    return

    def check_health(self) -> Optional[WorkerFailed]:
        """rank 0：None = 每个 rank 都还在；否则是让这一组停下的错误（一行，说出原因）。不通信、不阻塞（服务器的
        /health 在事件循环里调用它）：看记下的失败，再问 launch 有没有 worker 报告了错误或者退出了。"""
        if self.failure is None and (why := self.lost_worker()) is not None:
            self.failure = WorkerFailed(why)
        return self.failure

    def stop(self) -> None:
        """rank 0 收尾（拆掉进程组）之前：停掉心跳线程。正在发的心跳最多等它几秒。"""
        self._stopped.set()
        if self._lock.acquire(timeout=STOP_WAIT):
            self._lock.release()


def _is_heartbeat(obj) -> bool:
    return isinstance(obj, int) and obj == HEARTBEAT
