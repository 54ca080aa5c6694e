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

step12 的 KV 驱逐（evicting=True：策略不是 full）：块数都按槽（seq.kv_len）算。一个长提示词不再在接纳时一次分好
全部的块——那样驱逐就白做了——接纳时只分第一块 prefill 要写的槽，之后每一块 prefill 与 decode 一样，算之前把块表
补到覆盖它要写的槽（_grow），池子空了抢占最新的请求；拿到的块不够一整块 prefill 时这一块就少算几个 token。
换出保留它的槽、num_evicted 和分数；重算把它们清零（block_manager.free_seq），重新 prefill 时策略一块一块地重新作用。
命中前缀缓存时，命中的前缀加第一块 prefill 不超过 max_blocks 块（add_request 按预算检查过的、一个请求一次前向最多
占的块数）：命中得更多时只用前面几块、其余照常重算——否则池子再空也接纳不了它。snapkv（split_at_prompt）：prefill 的
一块不跨过提示词的末尾——它在那里投票、压缩一次，被重算的请求也在同一处压缩。
运行集合空着（池子里没人持有块）队头也接纳不了的请求永远跑不了：schedule 把它交给引擎（unschedulable），引擎结束它。
evicting=False 时与 step09 逐行相同。

step13：on_admit（引擎给的）在请求拿到块之后调用：标了段、走块缓存的请求在这里一次做完拼段的 prefill（blend.py），
num_computed_tokens 跳到 提示词长 − 1，这一步只再排它的最后一个提示词 token（普通的前向，采样出第一个 token）。
拼段的 prefill 算掉的 token（折算成走完全部层的，引擎报回来）记在这一步的预算里，与前向里的 token 一起不超过
max_num_batched_tokens：放不下就还块、留在队头等下一步。拼段的 prefill 分不开，比整个预算还大的那种只在
这一步什么别的都没排时接纳（一步只做它；先来先服务，后面的请求跟着等）。
"""
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

from .block_manager import BlockManager, PrefixMatch
from .sequence import Sequence, SequenceStatus
from .swap import SwapSpace


@dataclass
class SchedulerOutput:
    seqs: list[Sequence]
    num_new_tokens: list[int]     # 与 seqs 一一对应：这一步算几个 token
    is_prefill: bool              # 这一步有没有算 prefill（或被抢占后重算）的 token
    num_decode_tokens: int        # 其中 decode 的 token 数（已经在 decode 的请求各 1 个，加上它们要验证的猜测）
    num_admit_tokens: int = 0     # step13：接纳时拼段的 prefill 在前向之外算掉的 token（折算，不在 num_new_tokens 里）
    unschedulable: Optional[Sequence] = None   # 池子全空也接纳不了的队头：引擎以错误结束它


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_batch_size: int, max_num_batched_tokens: int,
                 swap: Optional[SwapSpace] = None, on_preempt: Optional[Callable[[Sequence], None]] = None,
                 evicting: bool = False, max_blocks: Optional[int] = None, split_at_prompt: bool = False,
                 on_admit: Optional[Callable[[Sequence, Optional[int]], Optional[int]]] = None):
        self.block_manager = block_manager
        # step13：请求拿到块之后、排进这一步之前调用（引擎：拼段的 prefill）：on_admit(seq, 上限) → 算掉的 token 数；
        # 代价超过上限（None = 不限）时什么也不做、返回 None
        self.on_admit = on_admit
        self.evicting = evicting                              # step12：有驱逐策略时块边算边分（见文件开头）
        self.max_blocks = max_blocks                          # step12：接纳时命中 + 第一块最多占几块（None = 不限）
        self.split_at_prompt = split_at_prompt                # step12 snapkv：prefill 的一块不跨过提示词的末尾
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
        preempted = self._grow()
        seqs = [seq for seq in self.running if not seq.in_prefill]      # 1) decode：各 1 个 token + 猜测
        budget = self.max_num_batched_tokens - len(seqs)
        for seq in seqs:
            budget -= self._fit_spec(seq, budget)
        num_new = [1 + len(seq.spec_token_ids) for seq in seqs]
        num_decode = sum(num_new)
        for seq in self.running:                                        # 2) 还没 prefill 完的，按进入的先后
            if seq.in_prefill and budget > 0:
                n = min(self._prefill_len(seq, budget), self._room(seq))
                if n > 0:                                               # 驱逐时：块表只覆盖到 _grow 分到的槽
                    seqs.append(seq)
                    num_new.append(n)
                    budget -= n
        # 3) 接纳新请求。这一步抢占过就不接：刚腾出来的块正是被抢占的请求要的，接了新请求它下一步又会被抢占
        admit_tokens = 0
        if budget > 0 and not preempted:
            admitted, admit_tokens = self._admit(budget)
            # step13：拼段的 prefill 已经算掉的先扣掉。_admit 只在扣完还给它留得下 1 个时接纳它，所以先扣、后扣每个请求
            # 分到的一样；只有"一步只做它"的那种会扣成 ≤ 0，它的最后一个 token 照样算（max(budget, 1)）
            budget -= admit_tokens
            for seq in admitted:
                seqs.append(seq)
                num_new.append(self._prefill_len(seq, max(budget, 1)))
                budget -= num_new[-1]
        # 没人在跑、这一步也没抢占（池子里没人持有块）却谁也接纳不了：队头永远跑不了
        stuck = (self.swapped or self.waiting or [None])[0] if not (seqs or preempted or self.running) else None
        return SchedulerOutput(seqs, num_new, sum(num_new) > num_decode, num_decode, admit_tokens, stuck)

    def _prefill_len(self, seq: Sequence, budget: int, computed: Optional[int] = None) -> int:
        """这一步最多算它几个 prefill token（从第 computed 个起，默认 num_computed_tokens）：还没算的，不超过预算；
        split_at_prompt 时不跨过提示词的末尾。"""
        computed = seq.num_computed_tokens if computed is None else computed
        n = min(seq.num_tokens - computed, budget)
        prompt = len(seq.request.prompt_ids)
        return min(n, prompt - computed) if self.split_at_prompt and computed < prompt else n

    def _room(self, seq: Sequence) -> int:
        """块表里还有几个空槽可写（step12 驱逐时 prefill 的一块不能超过它；不驱逐时块表早已覆盖全部 token）。"""
        if not self.evicting:
            return seq.num_tokens - seq.num_computed_tokens
        return len(seq.block_table) * self.block_manager.block_size - seq.kv_len

    def _slots_for(self, seq: Sequence, budget: int) -> int:
        """接纳 / 换入时块表要覆盖的槽：不驱逐时是全部 token（step09）；驱逐时只到这一步要算的那块为止。"""
        return seq.kv_len + (self._prefill_len(seq, budget) if self.evicting else seq.num_tokens - seq.num_computed_tokens)

    def _fit_spec(self, seq: Sequence, budget: int) -> int:
        """猜测最多用掉 budget 个预算；写它们的槽（位置 num_tokens .. num_tokens + k − 1）不在块表里就用空闲的块补上
        （与 vLLM 相同，没人用的前缀缓存块也算空闲、可以被回收：见文件开头），空闲的块不够就只猜到块表的末尾，
        从不为此抢占。返回留下的猜测数。"""
        seq.trim_spec(budget)
        bm = self.block_manager
        need = bm.blocks_for(seq.num_tokens_with_spec - seq.num_evicted) - len(seq.block_table)   # 按槽算（step12）
        if need > 0 and bm.can_allocate(need):
            seq.block_table += bm.allocate(need)
        seq.trim_spec(len(seq.block_table) * bm.block_size - (seq.num_tokens - seq.num_evicted))
        return len(seq.spec_token_ids)

    def _admit(self, budget: int) -> tuple[list[Sequence], int]:
        """按先来先服务从等待队列头部接纳请求，直到批满、这一步的预算被前面接纳的用完或块不够。
        先换入：swapped 清空之前不接纳等待中的请求。返回接纳的请求与 on_admit 在前向之外算掉的 token 数（step13）。"""
        batch, bm, admit_tokens = [], self.block_manager, 0
        while self.swapped and len(self.running) < self.max_batch_size and budget > 0:
            seq = self.swapped[0]
            need = bm.blocks_for(self._slots_for(seq, budget))
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
            return batch, admit_tokens        # 还有没换回来的：先不接新请求
        computing = set()                 # 这一批里各请求要算的第一个（以后能被命中的）满块的 key
        while self.waiting and len(self.running) < self.max_batch_size and budget > 0:
            seq = self.waiting[0]
            match = self.block_manager.match_prefix(seq)
            hit = len(match.blocks) * bm.block_size
            while self.max_blocks is not None and bm.blocks_for(hit + self._prefill_len(seq, budget, hit)) > self.max_blocks:
                match, hit = PrefixMatch(match.blocks[:-1], None), hit - bm.block_size   # 少用一块命中，它照常重算
            if match.next_key is not None and match.next_key in computing:
                break  # 前面有人正要算同一块：等下一步直接命中
            # 驱逐时只为第一块 prefill 分块：命中的前缀之后、这一步算得了的那些 token
            slots = hit + self._prefill_len(seq, budget, hit) if self.evicting else None
            if not self.block_manager.can_allocate_seq(seq, match, slots):
                break  # 不跳过队头去接后面的小请求：保持先来先服务，也不会饿死长请求
            self.block_manager.allocate_seq(seq, match, slots)   # 不驱逐时块按整段 token 一次分好：prefill 到一半不会缺块
            if self.on_admit is not None:                 # step13：标了段的请求在这里算完除最后一个 token 外的 prefill
                # 上限：给它的最后一个 token 留 1 个；这一步还什么都没排时不设上限（拼段的 prefill 分不开）
                spent = self.on_admit(seq, budget - 1 if budget < self.max_num_batched_tokens else None)
                if spent is None:                         # 这一步放不下：还块（分块时回收掉的缓存块回不来），等下一步
                    self.block_manager.free_seq(seq)
                    break
                if seq.is_finished:                       # 拼段出了错：引擎已经只结束了它（还了块，下一步报告）
                    continue
                budget -= spent
                admit_tokens += spent
            budget -= seq.num_tokens - seq.num_computed_tokens
            if match.next_key is not None:
                computing.add(match.next_key)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append(seq)
        return batch, admit_tokens

    def _grow(self) -> bool:
        """每个运行中的请求 decode 要写一个新位置：落在块表之外时先要一块；要不到就抢占最新的请求。
        step12 驱逐时，prefill 到一半的请求也一样：按 schedule 会给它的 token 数（同样的预算、同样的顺序）补块，
        空闲的块不够时先拿能拿到的（这一块少算几个 token），一个空槽也没有、池子又空了才抢占。
        返回这一步有没有抢占。"""
        bm, i, preempted = self.block_manager, 0, False
        budget = self.max_num_batched_tokens - sum(not seq.in_prefill for seq in self.running)
        while i < len(self.running):  # 从最老的开始，保证老请求先拿到块
            seq = self.running[i]
            if seq.in_prefill:
                if self.evicting and budget > 0:
                    n = self._prefill_len(seq, budget)
                    budget -= n
                    need = bm.blocks_for(seq.kv_len + n) - len(seq.block_table)
                    while need > 0 and self._room(seq) == 0 and not bm.can_allocate(1):
                        victim = self.running[-1]
                        self._preempt(victim)
                        preempted = True
                        if victim is seq:
                            return True
                    if need > 0:
                        seq.block_table += bm.allocate(min(need, bm.num_free_blocks))
                i += 1
                continue
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
        n = self.block_manager.blocks_for(seq.kv_len)   # 存着已算好的槽的块（最后一块可能没写满）
        if self.swap is not None and n > 0 and self.swap.can_swap_out(n):
            seq.swap_handle = self.swap.swap_out(seq.block_table[:n], seq.kv_len)   # 先拷走，再还块
            self.running.remove(seq)
            self.block_manager.free(seq.block_table)   # num_computed_tokens、num_evicted、分数不清零：K/V 还在，只是在第二层
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
