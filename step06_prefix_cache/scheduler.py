"""调度器：等待队列 + 运行集合，每一步决定"这次前向算谁、各算几个 token"。策略与 nano-vllm 相同：

- 每一步要么全是 prefill，要么全是 decode。有人在等、并且块够放下它的全部 token 时，先做 prefill
  （把新请求尽快拉进批里，批越满，一次读权重服务的请求越多）；否则所有运行中的请求各 decode 一个 token。
- decode 时某个请求的最后一块写满了，就再给它一块（一次只长一块）。池子空了：抢占"最新"的运行请求——
  释放它的全部块，放回等待队列的最前面，之后重新 prefill（重算，recompute）。最老的请求从不被别人抢占，
  而每个请求单独都放得进池子（add_request 时检查过），所以总能往前走。
- 请求一结束就把块还回去，下一步就能有新请求进来：这就是连续批处理（continuous batching）。

schedule() 给每个被选中的请求一个数：这一步算它的几个 token（prefill：还没进池子的全部；decode：1）。
引擎只看这个数，不用区分 prefill 和 decode（nano-vllm 的 postprocess 也是这个形状）。

step06：接纳时先查前缀缓存（block_manager.match_prefix），命中的块直接共享，请求从命中位置开始 prefill。
同一批里已经有人要算它要算的第一块（key 相同）时，它等下一步：那时那一块已经写好、登记了，它直接命中，
而不是在同一次前向里把同样的 K/V 再算一遍（SGLang 叫 in-batch prefix caching）。
"""
from collections import deque
from dataclasses import dataclass

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    seqs: list[Sequence]
    num_new_tokens: list[int]     # 与 seqs 一一对应：这一步算几个 token
    is_prefill: bool


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_batch_size: int, max_prefill_tokens: int):
        self.block_manager = block_manager
        self.max_batch_size = max_batch_size          # 运行集合最多几个请求（= decode 的批大小上限）
        self.max_prefill_tokens = max_prefill_tokens  # 一次 prefill 的 批大小 × 最长长度 上限（左填充后的张量大小）
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # 按进入运行集合的先后排列：running[-1] 就是"最新"的请求

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        prefill = self._admit()
        if prefill:
            return SchedulerOutput(prefill, [seq.num_tokens - seq.num_computed_tokens for seq in prefill], True)
        self._grow_for_decode()
        return SchedulerOutput(list(self.running), [1] * len(self.running), False)

    def _admit(self) -> list[Sequence]:
        """按先来先服务从等待队列头部接纳请求，直到批满、prefill 张量超限或块不够。"""
        batch = []
        computing = set()                 # 这一批里各请求要算的第一个（以后能被命中的）满块的 key
        while self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            match = self.block_manager.match_prefix(seq)
            if match.next_key is not None and match.next_key in computing:
                break  # 前面有人正要算同一块：等下一步直接命中
            num_new = seq.num_tokens - len(match.blocks) * self.block_manager.block_size
            if batch and not self._prefill_fits(batch, num_new):
                break  # 第一个总是放行：单个很长的提示词也要能 prefill
            if not self.block_manager.can_allocate_seq(seq, match):
                break  # 不跳过队头去接后面的小请求：保持先来先服务，也不会饿死长请求
            self.block_manager.allocate_seq(seq, match)
            if match.next_key is not None:
                computing.add(match.next_key)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append(seq)
        return batch

    def _prefill_fits(self, batch: list[Sequence], num_new_tokens: int) -> bool:
        """这一批 prefill 已经接纳了 batch，再加一个要算 num_new_tokens 个 token 的请求：左填充后的 B × L 还在上限内吗。"""
        longest = max([seq.num_tokens - seq.num_computed_tokens for seq in batch] + [num_new_tokens])
        return longest * (len(batch) + 1) <= self.max_prefill_tokens

    def _grow_for_decode(self) -> None:
        """每个运行中的请求 decode 要写一个新位置：落在块表之外时先要一块；要不到就抢占最新的请求。"""
        bm, i = self.block_manager, 0
        while i < len(self.running):  # 从最老的开始，保证老请求先拿到块
            seq = self.running[i]
            while bm.needs_slot(seq) and not bm.can_allocate(1):
                victim = self.running[-1]     # 池子空了：抢占最新的请求
                self._preempt(victim)
                if victim is seq:             # 轮到的正是最新的那个：它自己让出来，这一步不跑它
                    return
            if bm.needs_slot(seq):
                bm.append_slot(seq)
            i += 1

    def _preempt(self, seq: Sequence) -> None:
        """重算式抢占：扔掉它的 KV（释放全部块），保留已生成的 token；重新被接纳时 prefill 提示词 + 已生成部分。"""
        self.running.remove(seq)
        self.block_manager.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)  # 放回队头：它比所有还在等的请求都早到

    def finish(self, seq: Sequence, reason: str) -> None:
        """请求结束（生成完，或被 abort）：立刻把块还回去，离开运行集合 / 等待队列。"""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free_seq(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
