"""调度器：等待队列 + 运行集合，每一步决定"这次前向算谁"。策略与 nano-vllm 相同：

- 每一步要么全是 prefill，要么全是 decode。有人在等、并且块够放下它的提示词时，先做 prefill
  （把新请求尽快拉进批里，批越满，一次读权重服务的请求越多）；否则所有运行中的请求各 decode 一个 token。
- decode 时某个请求的最后一块写满了，就再给它一块（一次只长一块）。池子空了：抢占"最新"的运行请求——
  释放它的全部块，放回等待队列的最前面，之后重新 prefill（重算，recompute）。最老的请求从不被别人抢占，
  而每个请求单独都放得进池子（引擎启动前检查过），所以总能往前走。
- 请求一结束就把块还回去，下一步就能有新请求进来：这就是连续批处理（continuous batching）。
"""
from collections import deque
from dataclasses import dataclass

from .block_allocator import BlockAllocator
from .sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    is_prefill: bool


class Scheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_batch_size: int, max_prefill_tokens: int):
        self.allocator = allocator
        self.block_size = block_size
        self.max_batch_size = max_batch_size          # 运行集合最多几个请求（= decode 的批大小上限）
        self.max_prefill_tokens = max_prefill_tokens  # 一次 prefill 的 批大小 × 最长长度 上限（左填充后的张量大小）
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # 按进入运行集合的先后排列：running[-1] 就是"最新"的请求
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def schedule(self) -> ScheduledBatch:
        prefill = self._admit()
        if prefill:
            return ScheduledBatch(prefill, is_prefill=True)
        self._grow_for_decode()
        return ScheduledBatch(list(self.running), is_prefill=False)

    def _admit(self) -> list[Sequence]:
        """按先来先服务从等待队列头部接纳请求，直到批满、prefill 张量超限或块不够。
        被抢占过的请求要重算 提示词 + 已生成的 token，所以按 num_tokens（而不只是提示词）分配块。"""
        batch = []
        while self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            if batch and not self._prefill_fits(batch, seq.num_tokens):
                break  # 第一个总是放行：单个很长的提示词也要能 prefill
            need = self.blocks_for(seq.num_tokens)
            if not self.allocator.can_allocate(need):
                break  # 不跳过队头去接后面的小请求：保持先来先服务，也不会饿死长请求
            seq.block_table = self.allocator.allocate(need)
            seq.status = Status.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            batch.append(seq)
        return batch

    def _prefill_fits(self, batch: list[Sequence], num_new_tokens: int) -> bool:
        """这一批 prefill 已经接纳了 batch，再加一个要算 num_new_tokens 个 token 的请求：左填充后的 B × L 还在上限内吗。"""
        longest = max([seq.num_tokens - seq.num_cached_tokens for seq in batch] + [num_new_tokens])
        return longest * (len(batch) + 1) <= self.max_prefill_tokens

    def _grow_for_decode(self) -> None:
        """decode 要写入位置 num_tokens-1（上一步采样出的 token）：它落在块表之外时，先要一个新块。"""
        i = 0
        while i < len(self.running):  # 从最老的开始，保证老请求先拿到块
            seq = self.running[i]
            while seq.num_tokens > len(seq.block_table) * self.block_size and not self.allocator.can_allocate(1):
                victim = self.running.pop()   # 池子空了：抢占最新的请求
                self._preempt(victim)
                if victim is seq:             # 轮到的正是最新的那个：它自己让出来，这一步不跑它
                    return
            if seq.num_tokens > len(seq.block_table) * self.block_size:
                seq.block_table += self.allocator.allocate(1)
            i += 1

    def _preempt(self, seq: Sequence) -> None:
        """重算式抢占：扔掉它的 KV（释放全部块），保留已生成的 token；重新被接纳时 prefill 提示词 + 已生成部分。"""
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_cached_tokens = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)  # 放回队头：它比所有还在等的请求都早到

    def finish(self, seq: Sequence) -> None:
        """请求结束：立刻把块还给分配器，并离开运行集合。"""
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.status = Status.FINISHED
        self.running.remove(seq)
