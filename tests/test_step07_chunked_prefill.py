"""step07：展平的混合前向（手算的位置、掩码、槽号；与 step05 的 plan 分开跑每一段的 logits 相同），块边界落在提示词的
每一个位置上（池子里的 K/V 与一次 prefill 完的相同、输出 token 相同），预算调度的账目（含重算最后 1 个 token 不算
decode），请求陆续到达（虚拟时钟：谁在哪一步被调度只取决于步数），abort / 异常之后块全部还回来，随机负载 + 小池子的
浸泡测试，以及 run.py：--no-chunked-prefill 真的是 step06 的引擎（再加 --no-prefix-cache 是 step05 的）。

比较的标准：token 逐个相等（小模型上没有贴得那么近的 logit，不用 near-tie 容差）；K/V 按相对误差比
（分块改变了矩阵乘的形状，浮点末位可以不同），容差 1e-5。
"""
import json
import random

import pytest
import torch

from common import cli
from common.clock import VirtualClock
from common.errors import UserError
from common.harness import Arrival, pool_is_free, replay
from common.tokenizer import Tokenizer
from common.weights import load_model
from conftest import cli_error, one_arch
from step02_sampling.sampler import SamplingParams
from step03_kvcache_single.cache import PreallocKVCache
from step03_kvcache_single.engine import forward as forward_single
from step03_kvcache_single.engine import generate as generate_single
from step04_static_batching.request import Request
from step05_paged import engine as step05
from step05_paged.kv_cache import PagedKVCache as Step05Cache
from step06_prefix_cache import engine as step06
from step07_chunked_prefill import run as step07_run
from step07_chunked_prefill.analysis.varlen_bench import FLAT, compare as compare_varlen
from step07_chunked_prefill.engine import EngineConfig, LLMEngine, blocks_needed
from step07_chunked_prefill.kv_cache import PagedKVCache
from step07_chunked_prefill.sequence import Sequence, SequenceStatus

KV_RTOL = 1e-5


def step03_outputs(model, requests, eos_ids=()):
    return [generate_single(model, r.prompt_ids, r.max_new_tokens, r.params, eos_ids, r.ignore_eos) for r in requests]


def engine07(model, num_blocks, block_size=4, max_batch_size=4, budget=16, caching=True, eos_ids=(), clock=None):
    return LLMEngine(model, EngineConfig(num_blocks, block_size, max_batch_size, budget, caching), eos_ids=eos_ids,
                     clock=clock or VirtualClock())


def assert_idle(engine):
    """没有请求还在引擎里，每一块都能再分出去（前缀缓存留着的块引用计数为 0，也算空闲）。"""
    assert pool_is_free(engine) and not engine.has_unfinished_requests()
    assert not engine.scheduler.waiting and not engine.scheduler.running


def seq_at(prompt: list[int], outputs: list[int], computed: int, block_table: list[int]) -> Sequence:
    seq = Sequence(0, Request(prompt, 8), torch.Generator(), 0.0)
    seq.output_ids, seq.num_computed_tokens, seq.block_table = list(outputs), computed, block_table
    return seq


def spy_schedule(engine) -> list[list[tuple]]:
    """包住调度器（只是观察）：每一步记下 (request_id, 这一步算几个 token, 调度时是否 in_prefill, 被抢占过几次,
    这一步是否算到最后一个 token)。"""
    log, orig = [], engine.scheduler.schedule

    def schedule():
        out = orig()
        log.append([(s.request_id, n, getattr(s, "in_prefill", None), s.num_preemptions,   # step05/06 没有 in_prefill
                     s.num_computed_tokens + n == s.num_tokens) for s, n in zip(out.seqs, out.num_new_tokens)])
        return out
    engine.scheduler.schedule = schedule
    return log


# ---------- 一次混合前向：手算 ----------

@torch.inference_mode()
@one_arch
def test_mixed_forward_positions_slots_and_masks_by_hand(tiny):
    """块大小 4。两个 decode（d1：提示词 5 + 1 个输出；d2：提示词 9 + 1 个输出）、一个带已缓存前缀的块
    （c1：提示词 7，已缓存 4，这次算 3 个——算到末尾，要采样）、一个全新提示词的第一块（c2：提示词 6，这次算 3 个，不采样）。"""
    cache = PagedKVCache(tiny.cfg, 16, 4, "cpu", torch.float32, attention="gather")
    d1 = seq_at([11, 12, 13, 14, 15], [16], 5, [3, 7])
    d2 = seq_at(list(range(20, 29)), [29], 9, [0, 1, 2])
    c1 = seq_at([31, 32, 33, 34, 35, 36, 37], [], 4, [5, 6])
    c2 = seq_at([41, 42, 43, 44, 45, 46], [], 0, [8, 9])
    fwd = cache.plan([d1, d2, c1, c2], [1, 1, 3, 3])
    # 一行：两个 decode，然后 c1 的 3 个、c2 的 3 个；每个 token 在自己请求里的位置
    assert fwd.input_ids.tolist() == [[16, 29, 35, 36, 37, 41, 42, 43]]
    assert fwd.positions.tolist() == [[5, 9, 4, 5, 6, 0, 1, 2]]
    assert fwd.logits_index.tolist() == [0, 1, 4]            # d1、d2、c1 的最后一个 token；c2 还没算完，不采样
    assert fwd.logits_rows == [range(0, 1), range(1, 2), range(2, 3), range(3, 3)]   # 各请求在 logits 里的行；c2 没有
    dec, s1, s2 = fwd.segments
    assert dec.input_ids.shape == (2, 1) and s1.input_ids.shape == (1, 3) and s2.input_ids.shape == (1, 3)
    # 槽号 = 块号 × 4 + 块内偏移：d1 位置 5 在逻辑块 1（物理 7）偏移 1；d2 位置 9 在逻辑块 2（物理 2）偏移 1
    assert dec.slot_mapping.tolist() == [7 * 4 + 1, 2 * 4 + 1]
    assert s1.slot_mapping.tolist() == [6 * 4 + 0, 6 * 4 + 1, 6 * 4 + 2]     # 位置 4、5、6：逻辑块 1（物理 6）
    assert s2.slot_mapping.tolist() == [8 * 4 + 0, 8 * 4 + 1, 8 * 4 + 2]     # 位置 0、1、2
    # decode 段：读回各自的块（d1 补齐到 3 块），key 位置 ≤ 自己的位置
    assert dec.block_tables.tolist() == [[3, 7, cache.null_block], [0, 1, 2]]
    assert dec.mask[:, 0, 0, 0].tolist() == [[k <= 5 for k in range(12)], [k <= 9 for k in range(12)]]
    # c1：已缓存 4 个 + 这次 3 个，读 2 块 = 8 个 key；第 i 个 query（位置 4+i）看 key 0..4+i
    assert s1.block_tables.tolist() == [[5, 6]]
    assert s1.mask[0, 0, 0].tolist() == [[k <= p for k in range(8)] for p in (4, 5, 6)]
    # c2：全新的 prefill，只看自己的 3 个 K/V，普通的下三角；不读池子
    assert s2.read_rows is None and s2.mask[0, 0, 0].tolist() == [[k <= q for k in range(3)] for q in range(3)]
    # c2 的块表只用到这次算到的位置所在的块（后面的块接纳时就分好了，但这一步用不到）
    assert s2.block_tables.tolist() == [[8]]
    # paged：同一行、同样的槽，注意力一次内核调用：每个请求按行里的顺序给块表、key 数、query 数
    paged = PagedKVCache(tiny.cfg, 16, 4, "cpu", torch.float32).plan([d1, d2, c1, c2], [1, 1, 3, 3])
    assert paged.input_ids.tolist() == fwd.input_ids.tolist() and paged.positions.tolist() == fwd.positions.tolist()
    assert paged.slot_mapping.tolist() == [29, 9, 24, 25, 26, 32, 33, 34]
    assert paged.block_tables.tolist() == [[3, 7, 16], [0, 1, 2], [5, 6, 16], [8, 16, 16]]   # 16 = 空块
    assert paged.seq_lens.tolist() == [6, 10, 7, 3] and paged.query_lens.tolist() == [1, 1, 3, 3]


@torch.inference_mode()
@one_arch
def test_mixed_forward_logits_equal_running_each_segment_alone_with_step05(tiny):
    """同一步的状态，混合前向的 logits 与把每一段单独用 step05 的 plan（另一份代码、左填充的批）跑一次相同
    （同一个池子内容、同样的 K/V）。"""
    pool = torch.randn(PagedKVCache(tiny.cfg, 16, 4, "cpu", torch.float32).pool.shape,
                       generator=torch.Generator().manual_seed(0))

    def seqs():
        return [seq_at([11, 12, 13, 14, 15], [16], 5, [3, 7]), seq_at(list(range(20, 29)), [29], 9, [0, 1, 2]),
                seq_at([31, 32, 33, 34, 35, 36, 37], [], 4, [5, 6])]

    cache = PagedKVCache(tiny.cfg, 16, 4, "cpu", torch.float32)
    cache.pool.copy_(pool)
    fwd = cache.plan(seqs(), [1, 1, 3])
    mixed = tiny.model(fwd.input_ids, fwd.positions, fwd, logits_index=fwd.logits_index)[0]          # (3, V)
    ref = Step05Cache(tiny.cfg, 16, 4, "cpu", torch.float32)
    ref.pool.copy_(pool)
    group = seqs()
    alone = []
    for part, n in ((group[:2], [1, 1]), (group[2:], [3])):
        p = ref.plan(part, n)
        alone.append(tiny.model(p.input_ids, p.positions, p, last_only=True)[:, -1])                 # (B, V)
    torch.testing.assert_close(mixed, torch.cat(alone), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.pool, ref.pool, rtol=1e-5, atol=1e-5)      # 写进池子的 K/V 也相同


# ---------- 块边界落在每一个位置 ----------

@torch.inference_mode()
def test_chunk_boundary_at_every_position_gives_the_same_kv(tiny):
    """13 个 token 的提示词，先算前 k 个、再算剩下的（k = 1..12）：池子里 13 个位置的 K/V 与单独一次 prefill
    （step03 的连续缓存）写出的相同（相对误差 ≤ 1e-5），最后一个位置的 logits 也相同。"""
    prompt, bs = list(range(50, 63)), 4
    dense = PreallocKVCache(tiny.cfg, len(prompt), "cpu", torch.float32)
    ref_logits = forward_single(tiny.model, dense, prompt, start=0)            # (V,)
    ref = dense.kv[:, :, 0, :, :len(prompt)]                                   # (layers, 2, H_kv, 13, D)
    for k in range(1, len(prompt)):
        cache = PagedKVCache(tiny.cfg, 8, bs, "cpu", torch.float32)
        seq = seq_at(prompt, [], 0, [6, 2, 5, 0])                              # 故意打乱的物理块
        for n in (k, len(prompt) - k):
            fwd = cache.plan([seq], [n])
            logits = tiny.model(fwd.input_ids, fwd.positions, fwd, logits_index=fwd.logits_index)[0]
            seq.num_computed_tokens += n
        assert fwd.logits_index.numel() == 1                                   # 只有算到末尾的那一块采样
        got = cache.pool[:, :, seq.block_table].transpose(2, 3).flatten(3, 4)[:, :, :, :len(prompt)]
        # (layers, 2, 4, H_kv, bs, D) -> (layers, 2, H_kv, 4, bs, D) -> (layers, 2, H_kv, 16, D)
        assert float((got - ref).abs().max() / ref.abs().max()) <= KV_RTOL, k
        torch.testing.assert_close(logits[0], ref_logits, rtol=1e-5, atol=1e-5)


@one_arch
def test_every_budget_gives_the_same_tokens(tiny):
    """一个 13 个 token 的提示词单独跑，预算 k = 1..13：每次前向最多 k 个 token，所以块边界落在 k、2k、……——
    每个位置都当过一次第一个边界。输出与 step03 逐 token 相同；每个预算下 prefill 用了 ⌈13 / k⌉ 次前向。"""
    r = Request(list(range(50, 63)), 5, ignore_eos=True)
    ref = step03_outputs(tiny.model, [r])
    for k in range(1, 14):
        engine = engine07(tiny.model, 8, 4, max_batch_size=1, budget=k)
        out, st = engine.generate([r])
        assert out == ref, k
        assert st.num_forwards == -(-13 // k) + 4 and st.prefill_steps == -(-13 // k)
        assert_idle(engine)


# ---------- 调度的账目 ----------

@one_arch
def test_budget_schedule_by_hand(tiny):
    """预算 8、批上限 4、块大小 4。A（提示词 3）先到；B（提示词 10）同时到：
    第 1 步：A 整段 3 个 + B 的前 5 个 = 8；第 2 步：A decode 1 + B 剩下的 5 个 = 6（B 采样出首 token）；
    之后每步两个 decode。"""
    engine = engine07(tiny.model, 16, 4, max_batch_size=4, budget=8)
    log = spy_schedule(engine)
    reqs = [Request([5, 6, 7], 4, ignore_eos=True), Request(list(range(10, 20)), 3, ignore_eos=True)]
    out, st = engine.generate(reqs)
    assert [[n for _, n, *_ in step] for step in log] == [[3, 5], [1, 5], [1, 1], [1, 1]]
    assert [(x.prefill, x.rows, x.width, x.tokens, x.decode_tokens) for x in st.steps] == [
        (True, 1, 8, 8, 0), (True, 1, 6, 6, 1), (False, 1, 2, 2, 2), (False, 1, 2, 2, 2)]
    assert st.prefill_tokens == 13 and st.prefill_padding_slots == 0
    assert out == step03_outputs(tiny.model, reqs)


@one_arch
def test_identical_prompts_of_two_blocks_take_exactly_two_prefill_steps(tiny):
    """3 个相同的 8 token 提示词（块大小 4）：第 1 步只接纳第一个（别人要算的第 0 块它正在算），第 2 步另外两个
    命中第 0 块、一起接纳。第 1 块含最后一个 token，无论如何都要自己算，不能再等——曾经每步只接纳一个（3 步 prefill）。"""
    reqs = [Request(list(range(30, 38)), 3, ignore_eos=True) for _ in range(3)]
    engine = engine07(tiny.model, 16, 4, max_batch_size=4, budget=64)
    out, st = engine.generate(reqs)
    assert st.prefill_steps == 2 and st.cached_tokens == [0, 4, 4]
    assert out == step03_outputs(tiny.model, reqs)
    assert_idle(engine)


@one_arch
def test_recompute_ending_in_a_one_token_chunk_is_not_counted_as_decode(tiny):
    """池子 5 块、预算 3、不开前缀缓存：第 2 个请求被抢占，重算时最后一块只剩 1 个 token，和请求 0 的 decode
    排在同一次前向、同一段里。这 1 个 token 是重算（prefill），StepStats.decode_tokens 只数真正的 decode：1，
    不是 2；这一步算作有 prefill。每一步：decode_tokens = 调度时已经在 decode 的请求数。"""
    reqs = [Request(list(range(10 + 30 * i, 10 + 30 * i + p)), n, ignore_eos=True)
            for i, (p, n) in enumerate([(6, 12), (2, 6), (3, 9)])]
    engine = engine07(tiny.model, 5, 4, max_batch_size=3, budget=3, caching=False)
    log = spy_schedule(engine)
    out, st = engine.generate(reqs)
    assert out == step03_outputs(tiny.model, reqs)
    hits = [i for i, step_ in enumerate(log)                   # 重算的最后 1 个 token 与别人的 decode 同一步
            if any(pf and pre and n == 1 and last for _, n, pf, pre, last in step_)
            and any(not pf for _, _, pf, *_ in step_)]
    assert hits, "the workload no longer makes a recompute end with a 1-token chunk next to a decode"
    for i in hits:
        assert st.steps[i].prefill and st.steps[i].tokens == 2 and st.steps[i].decode_tokens == 1
    assert [x.decode_tokens for x in st.steps] == [sum(not pf for _, _, pf, *_ in step_) for step_ in log]
    assert [x.prefill for x in st.steps] == [any(pf for _, _, pf, *_ in step_) for step_ in log]
    assert_idle(engine)


@one_arch
def test_budget_smaller_than_batch_size_is_a_user_error(tiny):
    with pytest.raises(UserError, match="at least --max-batch-size"):
        LLMEngine(tiny.model, EngineConfig(16, 4, max_batch_size=8, max_num_batched_tokens=7))


@one_arch
def test_padding_is_measured_from_the_forward_shapes(tiny):
    """同时到达、长短不一的提示词：step06 的 prefill 左填充（浪费 > 0，由 (B, L) 与真实 token 数算出），
    step07 同样的请求一行排开，算出来是 0。"""
    reqs = [Request(list(range(start, start + n)), 3, ignore_eos=True) for start, n in ((10, 3), (20, 11), (40, 6))]
    out6, st6 = step06.LLMEngine(tiny.model, step06.EngineConfig(16, 4, 4), clock=VirtualClock()).generate(reqs)
    out7, st7 = engine07(tiny.model, 16, 4, 4, 64).generate(reqs)
    assert st6.prefill_padding_slots == 3 * 11 - 20 and st7.prefill_padding_slots == 0
    assert st7.steps[0].width == 20 and st7.prefill_tokens == 20
    assert out7 == out6 == step03_outputs(tiny.model, reqs)


# ---------- 块在每条路上都还回来 ----------

@one_arch
def test_abort_mid_chunked_prefill_frees_its_blocks(tiny):
    """B（13 个 token）分块 prefill 到一半时被 abort：它的块立刻还回来，下一步报告 finish_reason="abort"；
    同时在 decode 的 A 不受影响，输出仍与 step03 相同。"""
    a, b = Request([5, 6, 7], 6, ignore_eos=True), Request(list(range(50, 63)), 4, ignore_eos=True)
    engine = engine07(tiny.model, 16, 4, max_batch_size=4, budget=5)
    ra, rb = engine.add_request(a), engine.add_request(b)
    sa, sb = engine.seqs[ra], engine.seqs[rb]
    engine.step()
    engine.step()
    assert sb.in_prefill and 0 < sb.num_computed_tokens < 13 and len(sb.block_table) == 4   # 块接纳时一次分好
    held_by_a = len(sa.block_table)
    engine.abort(rb)
    assert sb.status is SequenceStatus.FINISHED and sb.block_table == []
    assert engine.block_manager.num_free_blocks == 16 - held_by_a
    assert sum(map(bool, engine.block_manager.ref_counts)) == held_by_a
    outs = engine.step()
    assert [(o.finished, o.finish_reason) for o in outs if o.request_id == rb] == [(True, "abort")]
    while engine.has_unfinished_requests():
        engine.step()
    assert sa.output_ids == step03_outputs(tiny.model, [a])[0]
    engine.abort(rb)                                     # 已结束的 id：什么也不做
    n = engine.num_steps
    assert engine.step() == [] and engine.num_steps == n
    assert_idle(engine)


@one_arch
def test_exception_inside_the_forward_propagates_and_frees_every_block(tiny, monkeypatch):
    """模型前向在第 3 次调用时抛错（请求正持有块）：异常原样传出 generate()，之后每一块都空闲、队列是空的；
    同一个引擎接着跑同一组请求，输出与 step03 相同（池子没有少块）。"""
    reqs = [Request(list(range(10 + 20 * i, 22 + 20 * i)), 6, ignore_eos=True) for i in range(3)]
    engine = engine07(tiny.model, 12, 4, max_batch_size=3, budget=8)
    orig, calls, held = tiny.model.forward, [0], []

    def forward(*args, **kw):
        calls[0] += 1
        if calls[0] == 3:
            held.append(sum(map(bool, engine.block_manager.ref_counts)))
            raise RuntimeError("boom in the forward")
        return orig(*args, **kw)
    monkeypatch.setattr(tiny.model, "forward", forward)
    with pytest.raises(RuntimeError, match="boom in the forward"):
        engine.generate(reqs)
    assert held and held[0] > 0                          # 抛错时真的有块被拿着
    assert_idle(engine)
    monkeypatch.undo()
    out, _ = engine.generate(reqs)
    assert out == step03_outputs(tiny.model, reqs)
    assert_idle(engine)


@one_arch
def test_generate_checks_every_request_before_running_any(tiny):
    """第二个请求放不进池子：generate() 在跑任何一步之前就报 UserError，第一个请求也被撤回，什么块都没拿着。"""
    engine = engine07(tiny.model, 4, 4, max_batch_size=2, budget=8)
    with pytest.raises(UserError, match="KV blocks"):
        engine.generate([Request([5, 6, 7], 4), Request(list(range(10, 30)), 4)])
    assert not engine.step_stats and engine.num_steps == 0
    assert_idle(engine)


# ---------- 请求陆续到达（虚拟时钟：一步 = 1 秒） ----------

@one_arch
def test_requests_are_scheduled_only_after_they_arrive(tiny):
    """虚拟时钟每步 1 秒。A 在 0 到达；B 在 2.5 到达，第 3 步（时刻 3）之前交给引擎；C 在 1000 到达，那时引擎早已空闲，
    时钟直接拨过去（不真的等，记在 idle_s）。每个 token 的时刻就是产出它的那一步的序号。
    step07：B 到达的那一步就和 A 的 decode 一起算（A 不停顿）；step06：那一步只给 B 做 prefill，A 停一步。"""
    a, b, c = (Request([5, 6, 7], 4, ignore_eos=True), Request([8, 9], 3, ignore_eos=True),
               Request([10, 11, 12, 13], 2, ignore_eos=True))
    arrivals = [Arrival(0.0, a), Arrival(2.5, b), Arrival(1000.0, c)]
    ref = step03_outputs(tiny.model, [a, b, c])
    expect = {"step07": [[0, 1, 2, 3], [3, 4, 5], [1000, 1001]], "step06": [[0, 1, 2, 4], [3, 4, 5], [1000, 1001]]}
    for name in expect:
        clock = VirtualClock(step_s=1.0)
        engine = (engine07(tiny.model, 16, 4, 4, 8, clock=clock) if name == "step07" else
                  step06.LLMEngine(tiny.model, step06.EngineConfig(16, 4, 4), clock=clock))
        log = spy_schedule(engine)
        out, st = replay(engine, arrivals, clock)
        assert out == ref, name
        assert st.arrival_s == [0, 3, 1000], name                   # 到达 = 交给引擎时的时钟读数（步的边界）
        assert st.token_s == expect[name], name
        assert st.idle_s == 1000 - 6 and st.wall_s == 8, name       # 8 步；6 → 1000 之间没有请求可做
        # 第 k 步调度了谁：B 最早出现在第 3 步，C 在第 6 步（时钟跳到 1000 后的第一步）
        first_step = {rid: min(i for i, step_ in enumerate(log) if any(r == rid for r, *_ in step_))
                      for rid in (0, 1, 2)}
        assert first_step == {0: 0, 1: 3, 2: 6}, name
        assert all(t >= arr for ts, arr in zip(st.token_s, st.arrival_s) for t in ts)
        assert_idle(engine)


@pytest.mark.parametrize("t", [-1.0, float("nan")])
@one_arch
def test_negative_or_nan_arrival_time_is_rejected(tiny, t):
    clock = VirtualClock()
    with pytest.raises(ValueError, match="arrival times"):
        replay(engine07(tiny.model, 16, clock=clock), [Arrival(t, Request([5], 2))], clock)


# ---------- 浸泡：随机到达、共享前缀、小池子 ----------

@one_arch
def test_soak_arrivals_shared_prefixes_tiny_pool_equals_step03(tiny):
    """30 个请求陆续到达（虚拟时钟，间隔 0–1.5 步），几组共享前缀，贪心 / 带种子采样混在一起；池子只比最大的请求多一点，
    预算 4 / 7 / 23：分块、抢占（包括 prefill 到一半的）、驱逐都会发生——覆盖只取决于步数，与机器快慢无关。
    每个输出都等于 step03 单独生成，结束后引用计数全为 0。"""
    rng = random.Random(7)
    prefixes = [[rng.randrange(2, 256) for _ in range(rng.randint(4, 24))] for _ in range(4)]
    arrivals, t = [], 0.0
    for i in range(30):
        params = SamplingParams(temperature=rng.choice([0.7, 1.0]), top_k=rng.choice([0, 20]), seed=i) \
            if rng.random() < 0.4 else SamplingParams()
        prompt = rng.choice(prefixes) + [rng.randrange(2, 256) for _ in range(rng.randint(0, 12))]
        arrivals.append(Arrival(t, Request(prompt, rng.randint(1, 14), params, ignore_eos=rng.random() < 0.5)))
        t += rng.uniform(0, 1.5)
    reqs = [a.request for a in arrivals]
    ref = step03_outputs(tiny.model, reqs, [1])
    num_blocks = max(blocks_needed(r, 4) for r in reqs) + 2
    totals = {"preemptions": 0, "mid_prefill": 0, "evictions": 0, "chunked": 0}
    for budget in (4, 7, 23):
        clock = VirtualClock()
        engine = engine07(tiny.model, num_blocks, 4, max_batch_size=4, budget=budget, eos_ids=[1], clock=clock)
        orig, partial = engine.scheduler.schedule, []

        def schedule(orig=orig, engine=engine, partial=partial):
            # 上一步之后还在 prefill 提示词的运行中请求，这一步调度时回到了等待队列：prefill 到一半被抢占
            before = [s for s in engine.scheduler.running if s.num_computed_tokens < len(s.request.prompt_ids)]
            out = orig()
            totals["mid_prefill"] += sum(s.status is SequenceStatus.WAITING for s in before)
            totals["chunked"] += sum(s.num_computed_tokens + n < len(s.request.prompt_ids)
                                     for s, n in zip(out.seqs, out.num_new_tokens))
            return out
        engine.scheduler.schedule = schedule
        out, st = replay(engine, arrivals, clock)
        assert out == ref, budget
        assert st.prefill_padding_slots == 0
        assert all(f >= a for f, a in zip(st.first_token_s, st.arrival_s))
        totals["preemptions"] += st.preemptions
        totals["evictions"] += engine.block_manager.num_evictions
        assert_idle(engine)
    assert all(totals.values()), totals


# ---------- 对照实验 ----------

@one_arch
def test_varlen_bench_three_ways_compute_the_same_logits(tiny):
    """varlen_bench 的三种做法（展平 + 按段、左填充 + 掩码、块对角掩码）在同一步上给出相同的 logits。"""
    s = cli.Session(tiny.model, None, tiny.cfg, None, "cpu", torch.float32)
    res = compare_varlen(s, [9, 14, 11], (6, 5), block_size=4, repeats=1)
    assert all(r["max_rel_diff"] <= 1e-5 and r["same_argmax"] for r in res.values())
    assert res[FLAT]["token_slots"] == 3 + 5


# ---------- --no-prefix-cache 与对话模板 ----------

@pytest.fixture(scope="module")
def tok_model(tiny_tok_dir):
    """词表、分词器、对话模板与默认模型相同的随机小模型。"""
    return load_model(tiny_tok_dir, "cpu", torch.float32), Tokenizer(tiny_tok_dir)


CHAT_TEXTS = ["Hi", "What is 2+2?", "Name a color.", "Tell me a joke."]


def test_no_prefix_cache_admits_a_full_batch_of_chat_prompts_in_one_step(tok_model):
    """每个 --chat 提示词都以同一段默认系统提示开头（共享前几块）。不开前缀缓存时没有"等别人算完同一块"这回事：
    第一步就接纳整批 4 个（曾经每步只接纳一个）。开着前缀缓存时第一步只接纳 1 个（其余等着命中它算的块）——
    这证明这些提示词确实共享第一块。"""
    model, tok = tok_model
    prompts = [tok.encode(t, chat=True) for t in CHAT_TEXTS]
    assert all(p[:16] == prompts[0][:16] for p in prompts)
    reqs = [Request(p, 2, ignore_eos=True) for p in prompts]
    for caching, admitted in ((False, 4), (True, 1)):
        engine = engine07(model, 64, 16, max_batch_size=4, budget=512, caching=caching)
        for r in reqs:
            engine.add_request(r)
        engine.step()
        assert len(engine.scheduler.running) == admitted and len(engine.scheduler.waiting) == 4 - admitted, caching
        assert engine.step_stats[0].tokens == sum(map(len, prompts[:admitted])), caching
        while engine.has_unfinished_requests():
            engine.step()
        assert_idle(engine)
    out, st = engine07(model, 64, 16, max_batch_size=4, budget=512, caching=False).generate(reqs)
    assert st.prefill_steps == 1 and st.num_forwards == 2 and st.cached_tokens == [0] * 4
    assert out == step03_outputs(model, reqs)


# ---------- 命令行（进程内，与命令行同一条路：cli.run_main） ----------

def run_json(argv, capsys) -> dict:
    with pytest.raises(SystemExit) as e:
        cli.run_main(step07_run.make_parser(), step07_run.main, argv)
    captured = capsys.readouterr()
    assert e.value.code == 0, captured.err[-2000:]
    return json.loads(captured.out.strip().splitlines()[-1])


def test_run_py_generation_mode_equals_step06(tiny_tok_dir, tok_model, capsys):
    """生成模式：预算 9（批上限 8），两个提示词分块 prefill；输出与 step06 的引擎相同，前向比它多（prefill 分了块），
    填充为 0。"""
    argv = ["--model", str(tiny_tok_dir), "--prompt", "The three primary colors are", "--prompt", "def fibonacci(n):",
            "--max-new-tokens", "6", "--ignore-eos", "--max-num-batched-tokens", "9", "--num-blocks", "64", "--json"]
    out = run_json(argv, capsys)
    reqs = [Request(x["prompt_ids"], 6, ignore_eos=True) for x in out["results"]]
    assert sum(len(r.prompt_ids) for r in reqs) > 9          # 两个提示词一次前向放不下：第二个真的分了块
    ref, st6 = step06.LLMEngine(tok_model[0], step06.EngineConfig(64, 16, 8)).generate(reqs)
    assert [x["output_ids"] for x in out["results"]] == ref
    assert out["stats"]["forwards"] > st6.num_forwards and out["stats"]["prefill_padding_waste"] == 0


@pytest.mark.parametrize("no_prefix_cache", [False, True])
def test_run_py_no_chunked_prefill_runs_the_previous_steps_engine(tiny_tok_dir, tok_model, capsys, no_prefix_cache):
    """--no-chunked-prefill 用 step06 的引擎（再加 --no-prefix-cache：step05 的）：输出、前向次数、prefill 填充、
    前缀缓存命中与直接跑那个引擎相同。负载选得能分辨：一个 1 token、一个 9 token 的提示词各采 2 个样本、预算 4——
    step07 的引擎会分块（前向次数不同、填充为 0），step06 / step05 把长短不一的提示词一起左填充 prefill（填充 > 0）；
    step06 的长提示词的第二个样本命中前两块，step05 没有前缀缓存。所以 run.py 选错引擎时这个测试会失败。"""
    model = tok_model[0]
    prompts = ["Hi", "The three primary colors are red, yellow and"]
    argv = ["--model", str(tiny_tok_dir), "--prompt", prompts[0], "--prompt", prompts[1], "--n", "2",
            "--temperature", "0.8", "--seed", "3", "--max-new-tokens", "5", "--ignore-eos",
            "--num-blocks", "64", "--block-size", "4", "--max-batch-size", "4", "--max-num-batched-tokens", "4",
            "--no-chunked-prefill", "--json"] + (["--no-prefix-cache"] if no_prefix_cache else [])
    out = run_json(argv, capsys)
    ids = [out["results"][0]["prompt_ids"], out["results"][2]["prompt_ids"]]
    reqs = [q for p in ids for q in Request(p, 5, SamplingParams(temperature=0.8, seed=3), True).parallel_samples(2)]
    assert [x["prompt_ids"] for x in out["results"]] == [r.prompt_ids for r in reqs]
    prev = step05 if no_prefix_cache else step06
    ref, st = prev.LLMEngine(model, prev.EngineConfig(64, 4, 4), eos_ids=()).generate(reqs)
    assert [x["output_ids"] for x in out["results"]] == ref
    assert out["stats"]["forwards"] == st.num_forwards
    assert out["stats"]["prefill_padding_waste"] == round(st.prefill_padding_waste, 4) > 0
    assert [x["cached_tokens"] for x in out["results"]] == st.cached_tokens
    assert (sum(st.cached_tokens) == 0) == no_prefix_cache
    # 同样的请求交给 step07 的引擎：前向次数不同，没有填充——这个负载分辨得出选的是哪个引擎
    _, st7 = engine07(model, 64, 4, 4, 4, caching=not no_prefix_cache).generate(reqs)
    assert st7.num_forwards != st.num_forwards and st7.prefill_padding_slots == 0


def test_run_py_budget_below_batch_size_is_a_user_error(tiny_tok_dir, capsys):
    line = cli_error(step07_run, ["--model", str(tiny_tok_dir), "--prompt", "hi", "--max-num-batched-tokens", "4"],
                     capsys)
    assert "at least --max-batch-size" in line
