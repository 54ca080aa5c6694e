"""调度器：等待队列 + 运行集合 + 被换出的队列，每一步决定"这次前向算谁、各算几个 token"。

每一步一个 token 预算（max_num_batched_tokens）：先 decode，再给还没 prefill 完的请求，还有剩、这一步又没有
抢占才接纳新请求（先查前缀缓存）。schedule() 给每个被选中的请求一个数：这一步算它的几个 token（prefill 的一块；
decode：1，带 k 个猜测时 1 + k），引擎只看这个数。decode 写满最后一块就再给它一块；池子空了抢占最新的
运行请求，最老的从不被抢占；请求一结束就还块（连续批处理）。
抢占时能换出（--preempt swap）就把块换出到第二层（swap.py），否则重算；swapped 清空之前不接纳新请求。

step09 加的投机解码：decode 中带着 k 个猜测的请求这一步算 1 + k 个 token（上一步采样出的 token + k 个猜测），
占 1 + k 个预算；它们要写的槽在前向之前就分好（lookahead）。猜测是锦上添花：每个 decode 先保证 1 个 token，
预算还有剩才给猜测；写猜测的块从不为此抢占别人——拿不到、预算不够就少猜几个（_fit_spec）。"拿得到"与其他分配
相同，包括前缀缓存里没人用、可以回收的块：猜测的槽可能挤掉一块缓存的前缀。vLLM V1 也是这样（allocate_slots
给猜测分块时，可用的块数就是 free_block_queue 的长度，其中有没人用的缓存块）：没人用的缓存块本来就是空闲的内存，
留着只是赌以后有人命中，而这些槽多半马上就用。
被抢占的请求扔掉它的猜测（下一步重新猜），调度器调用 on_preempt（引擎给的是 Proposer.free：草稿模型为它存的
KV 也还回去）。
"""
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus
from .swap import SwapSpace


@dataclass
class SchedulerOutput:
    seqs: list[Sequence]
    num_new_tokens: list[int]     # 与 seqs 一一对应：这一步算几个 token
    is_prefill: bool              # 这一步有没有算 prefill（或被抢占后重算）的 token
    num_decode_tokens: int        # 其中 decode 的 token 数（已经在 decode 的请求各 1 个，加上它们要验证的猜测）


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_batch_size: int, max_num_batched_tokens: int,
                 swap: Optional[SwapSpace] = None, on_preempt: Optional[Callable[[Sequence], None]] = None):
        self.block_manager = block_manager
        self.swap = swap                                      # None = --preempt recompute
        self.on_preempt = on_preempt                          # 请求被抢占时调用（引擎：提议者丢掉为它存的状态）
        self.max_batch_size = max_batch_size                  # 运行集合最多几个请求（= decode 的批大小上限）
        self.max_num_batched_tokens = max_num_batched_tokens  # 一次前向最多算多少个 token
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # 按进入运行集合的先后排列：running[-1] 就是"最新"的请求
        self.swapped: deque[Sequence] = deque()   # 被换出的请求，最早到达的在队头

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> SchedulerOutput:
        preempted = self._grow_for_decode()
        seqs = [seq for seq in self.running if not seq.in_prefill]      # 1) decode：各 1 个 token + 猜测
        budget = self.max_num_batched_tokens - len(seqs)
        for seq in seqs:
            budget -= self._fit_spec(seq, budget)
        num_new = [1 + len(seq.spec_token_ids) for seq in seqs]
        num_decode = sum(num_new)
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
        return SchedulerOutput(seqs, num_new, sum(num_new) > num_decode, num_decode)

    def _fit_spec(self, seq: Sequence, budget: int) -> int:
        """猜测最多用掉 budget 个预算；写它们的槽（位置 num_tokens .. num_tokens + k − 1）不在块表里就用空闲的块补上
        （与 vLLM 相同，没人用的前缀缓存块也算空闲、可以被回收：见文件开头），空闲的块不够就只猜到块表的末尾，
        从不为此抢占。返回留下的猜测数。"""
        seq.trim_spec(budget)
        bm = self.block_manager
        need = bm.blocks_for(seq.num_tokens_with_spec) - len(seq.block_table)
        if need > 0 and bm.can_allocate(need):
            seq.block_table += bm.allocate(need)
        seq.trim_spec(len(seq.block_table) * bm.block_size - seq.num_tokens)
        return len(seq.spec_token_ids)

    def _admit(self, budget: int) -> list[Sequence]:
        """按先来先服务从等待队列头部接纳请求，直到批满、这一步的预算被前面接纳的用完或块不够。
        先换入：swapped 清空之前不接纳等待中的请求。"""
        batch, bm = [], self.block_manager
        while self.swapped and len(self.running) < self.max_batch_size and budget > 0:
            seq = self.swapped[0]
            need = bm.blocks_for(seq.num_tokens)
            if not bm.can_allocate(need):
                break
            seq.block_table = bm.allocate(need)
            self.swap.swap_in(seq.swap_handle, seq.block_table[:len(seq.swap_handle.cpu_blocks)])
            seq.swap_handle = None
            seq.num_registered_blocks = 0     # 新块号：从第 0 块起重新登记进前缀缓存（内容与原来相同）
            budget -= seq.num_tokens - seq.num_computed_tokens   # decode 中被换出的是 1；prefill 到一半的更多
            self.swapped.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append(seq)
        if self.swapped:
            return batch                      # 还有没换回来的：先不接新请求
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
        """能换出就换出（保留 KV）；否则重算式抢占：扔掉它的 KV（释放全部块），保留已生成的 token，
        重新被接纳时 prefill 提示词 + 已生成部分。"""
        seq.trim_spec(0)              # 猜测作废：回来以后重新猜
        if self.on_preempt is not None:
            self.on_preempt(seq)
        n = self.block_manager.blocks_for(seq.num_computed_tokens)   # 存着已算好 token 的块（最后一块可能没写满）
        if self.swap is not None and n > 0 and self.swap.can_swap_out(n):
            seq.swap_handle = self.swap.swap_out(seq.block_table[:n], seq.num_computed_tokens)   # 先拷走，再还块
            self.running.remove(seq)
            self.block_manager.free(seq.block_table)   # num_computed_tokens 不清零：K/V 还在，只是在第二层
            seq.block_table = []
            seq.status = SequenceStatus.SWAPPED
            seq.num_preemptions += 1
            # 放队头：换出的请求没回来之前不接新请求，所以运行集合里最新的这个也比已换出的都早到
            self.swapped.appendleft(seq)
            return
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
        elif seq.status is SequenceStatus.SWAPPED:   # 被 abort 的换出请求：第二层的块也要还
            self.swapped.remove(seq)
            self.swap.free(seq.swap_handle)
            seq.swap_handle = None
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
