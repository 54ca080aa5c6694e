"""step11 的测试用的假引擎：严格实现 step API（add_request / step / abort / has_unfinished_requests / generate，
scheduler.waiting / running，block_manager.num_blocks / num_free_blocks），"模型"是一张写死的回答表。

用它测服务器本身（并发、断开、背压、关闭），每一步的时间可以任意设（step_s），不依赖机器快慢；
与真实引擎（小模型）的逐 token 相等由 test_step11_serving.py 里用真实引擎的测试负责。
"""
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import NamedTuple, Optional

import pytest

from common.errors import UserError

REPLY = "你好！我是一个很小的模型。长城很长，Hello world. 😀 The end."


@dataclass
class RequestOutput:
    request_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: Optional[str]
    num_cached_tokens: int
    error: Optional[Exception] = None     # finish_reason "error"：这个请求自己的后处理出错（引擎只结束它）


@dataclass(eq=False)
class _Seq:
    id: int
    request: object
    rng: random.Random
    output_ids: list[int] = field(default_factory=list)
    blocks: int = 0

    @property
    def request_id(self) -> int:           # 与真实引擎的 Sequence 同名：服务器从 scheduler.running 认出谁进了批
        return self.id


class GenerateOutput(NamedTuple):
    outputs: list[list[int]]
    stats: object = None            # 假引擎不记账


class FakeBlockManager:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.num_free_blocks = num_blocks


class FakeEngine:
    def __init__(self, tok, num_blocks: int = 256, block_size: int = 4, max_batch_size: int = 8,
                 context_len: int = 2048, step_s: float = 0.0):
        self.tok, self.block_size, self.max_batch_size, self.context_len, self.step_s = \
            tok, block_size, max_batch_size, context_len, step_s
        self.eos_ids = list(tok.eos_ids)
        self.reply_ids = tok.encode(REPLY) + self.eos_ids[:1]     # 贪心时循环吐这张表（含 EOS）
        self.scheduler = SimpleNamespace(waiting=deque(), running=[])
        self.block_manager = FakeBlockManager(num_blocks)
        self._aborted: list[int] = []
        self._next_id = 0
        self.peak_running = 0

    # ---- step API ----
    def add_request(self, r) -> int:
        r.validate(self.context_len)
        if self._blocks_for(len(r.prompt_ids) + r.max_new_tokens - 1) > self.block_manager.num_blocks:
            raise UserError("request is too big for the KV pool")
        seq = _Seq(self._next_id, r, random.Random(r.params.seed))
        self._next_id += 1
        self.scheduler.waiting.append(seq)
        return seq.id

    def abort(self, request_id: int) -> None:
        for q in (self.scheduler.waiting, self.scheduler.running):
            for seq in list(q):
                if seq.id == request_id:
                    q.remove(seq)
                    self._free(seq)
                    self._aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self._aborted)

    def step(self) -> list[RequestOutput]:
        outs = [RequestOutput(rid, [], True, "abort", 0) for rid in self._aborted]
        self._aborted = []
        sched, bm = self.scheduler, self.block_manager
        while sched.waiting and len(sched.running) < self.max_batch_size:
            seq = sched.waiting[0]
            need = self._blocks_for(len(seq.request.prompt_ids) + 1)
            if need > bm.num_free_blocks:
                break
            sched.waiting.popleft()
            self._grow(seq, need)
            sched.running.append(seq)
        self.peak_running = max(self.peak_running, len(sched.running))
        for seq in list(sched.running):
            need = self._blocks_for(len(seq.request.prompt_ids) + len(seq.output_ids) + 1)
            if need > seq.blocks:
                if need - seq.blocks > bm.num_free_blocks:
                    continue                      # 池子满了：这一步它不前进（真实引擎会抢占）
                self._grow(seq, need)
            try:
                token = self._next_token(seq)
            except Exception as e:                # 与真实引擎相同：只属于这个请求的失败只结束它
                outs.append(RequestOutput(seq.id, [], True, "error", 0, e))
                sched.running.remove(seq)
                self._free(seq)
                continue
            seq.output_ids.append(token)
            reason = self._finish_reason(seq, token)
            outs.append(RequestOutput(seq.id, [token], reason is not None, reason, 0))
            if reason is not None:
                sched.running.remove(seq)
                self._free(seq)
        if self.step_s:
            time.sleep(self.step_s)
        return outs

    def generate(self, requests) -> GenerateOutput:
        ids = [self.add_request(r) for r in requests]
        out = {i: [] for i in ids}
        while self.has_unfinished_requests():
            for o in self.step():
                out[o.request_id] += o.new_token_ids
        return GenerateOutput([out[i] for i in ids])

    # ---- 内部 ----
    def _blocks_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.block_size)

    def _grow(self, seq, need):
        self.block_manager.num_free_blocks -= need - seq.blocks
        seq.blocks = need

    def _free(self, seq):
        self.block_manager.num_free_blocks += seq.blocks
        seq.blocks = 0

    def _next_token(self, seq) -> int:
        table = self.reply_ids
        if seq.request.params.greedy:
            return table[(sum(seq.request.prompt_ids) + len(seq.output_ids)) % len(table)]
        return table[seq.rng.randrange(len(table))]

    def _finish_reason(self, seq, token) -> Optional[str]:
        r = seq.request
        if token in self.eos_ids and not r.ignore_eos:
            return "stop"
        if r.stop and any(s in self.tok.decode(seq.output_ids) for s in r.stop):
            return "stop"
        if len(seq.output_ids) == r.max_new_tokens:
            return "length"
        return None


# ---- 假引擎自己也要守 step API 的约定，否则用它测出的服务器行为不算数 ----
def test_fake_engine_keeps_the_step_api(tiny_tok_dir):
    from common.tokenizer import Tokenizer
    from step02_sampling.sampler import SamplingParams
    from step04_static_batching.request import Request
    tok = Tokenizer(tiny_tok_dir)
    e = FakeEngine(tok, num_blocks=16, block_size=4, max_batch_size=2)
    a = e.add_request(Request([5, 6, 7], 6, ignore_eos=True))
    b = e.add_request(Request([8, 9], 6, SamplingParams(temperature=0.8, seed=1), ignore_eos=True))
    c = e.add_request(Request([1], 3, ignore_eos=True))
    outs = e.step()
    assert [o.request_id for o in outs] == [a, b] and all(len(o.new_token_ids) == 1 for o in outs)
    assert len(e.scheduler.running) == 2 and len(e.scheduler.waiting) == 1
    e.abort(b)                                   # 立刻还块；下一步报告 abort
    assert e.block_manager.num_free_blocks == 16 - 1
    outs = e.step()
    assert outs[0].request_id == b and outs[0].finished and outs[0].finish_reason == "abort"
    while e.has_unfinished_requests():
        e.step()
    assert e.block_manager.num_free_blocks == 16
    with pytest.raises(UserError):
        e.add_request(Request([1] * 60, 10))      # 放不进 16 块 × 4
    seeded = [Request([8, 9], 6, SamplingParams(temperature=0.8, seed=1), ignore_eos=True)] * 2
    x, y = FakeEngine(tok).generate(seeded).outputs
    assert x == y and len(x) == 6                 # 同一个种子，同样的 token
