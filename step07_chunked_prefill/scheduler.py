"""调度器：等待队列 + 运行集合，每一步决定"这次前向算谁、各算几个 token"。

step07 加的 token 预算（max_num_batched_tokens，vLLM 的同名参数）：decode 与 prefill 的块混在同一次前向里
（step05/06 的一步要么全是 prefill、要么全是 decode：一个长提示词到了，所有正在 decode 的请求都干等一整次长
prefill）。先 decode：运行中每个已经在 decode 的请求各占 1 个预算；剩下的按进入运行集合的顺序给还没 prefill 完的
请求（每个拿 min(剩下的, 预算)）；还有剩、这一步又没有抢占，才按先来先服务接纳新请求。一个提示词可能要分好几步
才 prefill 完，最后一块算完的那一步才采样出首 token。

schedule() 给每个被选中的请求一个数：这一步算它的几个 token（prefill 的一块；decode：1），引擎只看这个数。
没变的：decode 写满最后一块就再给它一块；池子空了抢占最新的运行请求（重算），最老的从不被抢占；请求一结束就
还块（连续批处理）；接纳时先查前缀缓存，同一批里有人正要算同一块时等下一步。
"""
from collections import deque
from dataclasses import dataclass

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    seqs: list[Sequence]
    num_new_tokens: list[int]     # 与 seqs 一一对应：这一步算几个 token
    is_prefill: bool              # 这一步有没有算 prefill（或被抢占后重算）的 token
    num_decode_tokens: int        # 其中 decode 的 token 数（已经在 decode 的请求各 1 个）


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_batch_size: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_batch_size = max_batch_size                  # 运行集合最多几个请求（= decode 的批大小上限）
        self.max_num_batched_tokens = max_num_batched_tokens  # 一次前向最多算多少个 token
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # 按进入运行集合的先后排列：running[-1] 就是"最新"的请求

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        preempted = self._grow_for_decode()
        seqs = [seq for seq in self.running if not seq.in_prefill]      # 1) decode：各 1 个 token
        num_new = [1] * len(seqs)
        budget = self.max_num_batched_tokens - len(seqs)
        for seq in self.running:                                        # 2) 还没 prefill 完的，按进入的先后
            if seq.in_prefill and budget > 0:
                seqs.append(seq)
                num_new.append(min(seq.num_tokens - seq.num_computed_tokens, budget))
                budget -= num_new[-1]
        # 3) 接纳新请求。这一步抢占过就不接：刚腾出来的块正是被抢占的请求要的，接了新请求它下一步又会被抢占
        if budget > 0 and not preempted:
            for seq in self._admit(budget):
                seqs.append(seq)
                num_new.append(min(seq.num_tokens - seq.num_computed_tokens, budget))
                budget -= num_new[-1]
        num_decode = sum(not seq.in_prefill for seq in seqs)
        return SchedulerOutput(seqs, num_new, sum(num_new) > num_decode, num_decode)

    def _admit(self, budget: int) -> list[Sequence]:
        """按先来先服务从等待队列头部接纳请求，直到批满、这一步的预算被前面接纳的用完或块不够。"""
        batch = []
        computing = set()                 # 这一批里各请求要算的第一个（以后能被命中的）满块的 key
        while self.waiting and len(self.running) < self.max_batch_size and budget > 0:
            seq = self.waiting[0]
            match = self.block_manager.match_prefix(seq)
            if match.next_key is not None and match.next_key in computing:
                break  # 前面有人正要算同一块：等下一步直接命中
            if not self.block_manager.can_allocate_seq(seq, match):
                break  # 不跳过队头去接后面的小请求：保持先来先服务，也不会饿死长请求
            self.block_manager.allocate_seq(seq, match)   # 块按整段 token 一次分好：prefill 到一半不会缺块
            budget -= seq.num_tokens - seq.num_computed_tokens
            if match.next_key is not None:
                computing.add(match.next_key)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append(seq)
        return batch

    def _grow_for_decode(self) -> bool:
        """每个运行中的请求 decode 要写一个新位置：落在块表之外时先要一块；要不到就抢占最新的请求。
        返回这一步有没有抢占。"""
        bm, i, preempted = self.block_manager, 0, False
        while i < len(self.running):  # 从最老的开始，保证老请求先拿到块
            seq = self.running[i]
            while bm.needs_slot(seq) and not bm.can_allocate(1):
                victim = self.running[-1]     # 池子空了：抢占最新的请求
                self._preempt(victim)
                preempted = True
                if victim is seq:             # 轮到的正是最新的那个：它自己让出来，这一步不跑它
                    return True
            if bm.needs_slot(seq):
                bm.append_slot(seq)
            i += 1
        return preempted

    def _preempt(self, seq: Sequence) -> None:
        """重算式抢占：扔掉它的 KV（释放全部块），保留已生成的 token；重新被接纳时 prefill 提示词 + 已生成部分。"""
        self.running.remove(seq)
        self.block_manager.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_prefill_tokens = seq.num_tokens   # 重新接纳后从头（或从命中的前缀）再 prefill 到这里
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
