"""编译的 decode（perf/compiled_decode.py）：每个批大小桶一张图，补齐的行不改变任何真实请求的输出。

全部测试共用一个 CompiledDecodeModel（桶 1、2、4；同一个随机小模型、同样形状的池子），每个桶只编译一次。
编译用真正的 inductor：第一次（磁盘缓存是空的）要为每个桶编十来个 C++ 内核，之后的运行从
<缓存目录>/inductor 读回（use_inductor_cache_dir）。速度只由 bench/decode_speed.py 测量，这里不计时。
"""
import random

import pytest
import torch
from torch._dynamo.utils import counters

from common.clock import VirtualClock
from common.compare import MARGIN_TOL, compare
from common.harness import Arrival, pool_is_free, replay
from conftest import cli_error, make_tiny_model_dir
from common.weights import load_model
from perf import compiled_decode as cd
from step02_sampling.sampler import SamplingParams, draw_margin
from step04_static_batching.request import Request
from step05_paged import engine as step05
from step05_paged.paged_attention import paged_attention_op
from step07_chunked_prefill import engine as step07

BUCKETS = (1, 2, 4)
NUM_BLOCKS, BLOCK_SIZE = 14, 4       # 测试里引擎的池子：小到会抢占


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("cd"), "llama"), "cpu", torch.float32)


@pytest.fixture(scope="module")
def compiled(model):
    """桶 1、2、4 各编译一次（用一个 step05 引擎的池子预热：只写空块）。这个池子比测试里别的引擎的大：
    池子的块数不进图的形状，别的引擎直接用这组图，不重新编译。"""
    engine = step05.LLMEngine(model, step05.EngineConfig(3 * NUM_BLOCKS, BLOCK_SIZE, 4))
    cd.use_inductor_cache_dir()
    wrapper = cd.CompiledDecodeModel(model, BUCKETS, cd.block_table_width(engine))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)            # 与测试本身相同（conftest 让小模型的测试单线程跑）：dynamo 按线程数守卫图
    try:
        wrapper.warm_up(engine.kv_cache.pool, progress=False)
    finally:
        torch.set_num_threads(threads)
    assert sorted(wrapper.stats) == list(BUCKETS)
    return wrapper


def full_logits(model):
    @torch.inference_mode()
    def fn(ids):
        return model(torch.tensor([ids]), torch.arange(len(ids))[None])[0]     # (T, V)
    return fn


def spy(wrapper, monkeypatch) -> list[tuple[int, int]]:
    """记下每一次编译图的调用：(真实行数 R, 桶 Bp)。"""
    calls, orig = [], wrapper.run_bucket

    def run_bucket(Bp, pool, input_ids, *rest):
        calls.append((input_ids.shape[0], Bp))
        return orig(Bp, pool, input_ids, *rest)
    monkeypatch.setattr(wrapper, "run_bucket", run_bucket)
    return calls


def workload(seed: int = 3) -> list[Arrival]:
    """请求一个一个到达（批从 1 长到 4），长度各不相同（一个一个结束：4 → 3 → 2 → 1）；共享前缀（前缀命中）；
    贪心与带种子的采样混在一起。"""
    rng = random.Random(seed)
    prefix = [rng.randrange(2, 256) for _ in range(5)]
    arrivals = []
    for i, (t, n) in enumerate([(0, 18), (2, 12), (3, 22), (4, 20), (9, 11), (26, 14)]):
        params = SamplingParams(temperature=0.9, top_k=30, seed=i) if i % 2 else SamplingParams()
        prompt = prefix + [rng.randrange(2, 256) for _ in range(rng.randint(1, 3))]
        arrivals.append(Arrival(t, Request(prompt, n, params, ignore_eos=True)))
    return arrivals


def check_equal(model, arrivals, ref, got):
    for i, (a, r, g) in enumerate(zip(arrivals, ref, got)):
        c = compare(f"request {i}", a.request.prompt_ids, r, g, full_logits(model), MARGIN_TOL[torch.float32],
                    draw_margin(a.request.params))
        assert c.ok, c.describe()


@pytest.mark.parametrize("step", ["step05", "step07"])
def test_compiled_equals_eager_as_the_batch_grows_and_shrinks(model, compiled, monkeypatch, step):
    """同一个负载在 eager 引擎和编译的引擎上跑出同样的 token（run.py 的"相等"规则），贪心和带种子的采样都是；
    step07 的池子小到要抢占、前缀缓存有命中。编译的图真的被用到了：桶 1、2、4 都有，批先变大后变小，
    有的步补了行（R < Bp：一个请求在桶里结束之后），两个引擎都抢占过；池子比预热时小，图照用、不重新编译。"""
    arrivals = workload()

    def engine():
        if step == "step05":
            return step05.LLMEngine(model, step05.EngineConfig(NUM_BLOCKS, BLOCK_SIZE, 4), clock=VirtualClock())
        return step07.LLMEngine(model, step07.EngineConfig(NUM_BLOCKS, BLOCK_SIZE, 4, 16), clock=VirtualClock())
    eager = engine()
    ref, ref_st = replay(eager, arrivals, eager.clock)
    fast = engine()
    calls = spy(compiled, monkeypatch)
    assert cd.compile_engine(fast, compiled=compiled, progress=False)
    graphs = counters["stats"]["unique_graphs"]
    got, st = replay(fast, arrivals, fast.clock)
    assert counters["stats"]["unique_graphs"] == graphs                  # 池子的块数不同，也没有重新编译
    check_equal(model, arrivals, ref, got)
    rows = [r for r, _ in calls]
    assert {b for _, b in calls} == set(BUCKETS)
    peak = rows.index(max(rows))
    assert max(rows) == 4 and rows[0] == 1 and rows[-1] == 1 and 0 < peak < len(rows) - 1   # 先长后缩
    assert any(r < b for r, b in calls)                                  # 有补齐的步
    assert len(calls) >= st.decode_steps > 0 and st.num_forwards == ref_st.num_forwards   # 每个纯 decode 步都走了图
    assert st.preemptions > 0
    if step == "step07":
        assert sum(st.cached_tokens) > 0
    assert pool_is_free(fast)


@torch.inference_mode()
def test_padding_rows_write_only_the_null_block_and_change_no_real_row(model, compiled):
    """桶 4 里 3 个真实行 + 1 个补齐行：真实行的 logits 与第 4 行换成另一个真实请求时逐位相同；池子里被写过的槽
    正好是 3 个真实行各自的槽加上空块的第 0 个槽（补齐行只写空块：第 4 个请求自己的槽、别人的块一个都没碰）；
    空块里事先塞满 NaN 也不影响真实行（没有真实的行读它）。检查能失败：把真实行的块写坏，logits 就变了。"""
    engine = step05.LLMEngine(model, step05.EngineConfig(NUM_BLOCKS, BLOCK_SIZE, 4))
    for i in range(4):
        engine.add_request(Request(list(range(10 + i, 17 + 2 * i)), 8, SamplingParams(), ignore_eos=True))
    engine.step()                                                        # 4 个一起 prefill
    batch = engine.scheduler.schedule()
    fwd = engine.kv_cache.plan(batch.seqs, batch.num_new_tokens)         # 4 行 decode 的地址
    pool = engine.kv_cache.pool
    rows = (fwd.input_ids[:, 0], fwd.positions[:, 0], fwd.slot_mapping, fwd.block_tables, fwd.seq_lens)

    def run(n):                                                          # 前 n 行真实，其余补齐；池子先复原
        saved = pool.clone()
        out = compiled.run_bucket(4, pool, *(x[:n] for x in rows))
        after = pool.clone()
        pool.copy_(saved)
        return out, after

    full, _ = run(4)
    pool[:, :, -1] = float("nan")                                        # 空块：全是 NaN
    padded, after = run(3)
    assert torch.equal(padded[:3], full[:3])                             # 补齐行的输出是什么都行，没人用
    changed = (after != pool) & ~(torch.isnan(after) & torch.isnan(pool))   # (层, K/V, 块, 头, 块内偏移, D)
    written = changed.any(5).any(3).any(1).any(0).flatten().nonzero().flatten().tolist()   # 槽号 = 块号 × 块大小 + 偏移
    assert set(written) == set(fwd.slot_mapping[:3].tolist()) | {NUM_BLOCKS * BLOCK_SIZE}   # 空块的块号 = NUM_BLOCKS
    assert int(fwd.slot_mapping[3]) not in written                    # 第 4 个请求这次是补齐的行：它的槽没被写
    real_blocks = sorted({int(s) // BLOCK_SIZE for s in fwd.slot_mapping[:3]})
    pool[:, :, real_blocks[0]] = 1e3                                     # 真实行读的块写坏：必须看得出来
    broken, _ = run(3)
    assert not torch.equal(broken[:3], full[:3])


def test_request_finishing_mid_bucket_leaves_the_others_unchanged(model, compiled, monkeypatch):
    """桶 4 里 4 个请求，最短的先结束：之后 3 行补 1 行，其余 3 个的 token 与它们各自单独跑（桶 1）时相同。"""
    reqs = [Request([5 + i, 9, 70 + i], n, SamplingParams(), ignore_eos=True) for i, n in enumerate([3, 10, 10, 10])]
    alone = []
    for r in reqs:
        e = step05.LLMEngine(model, step05.EngineConfig(NUM_BLOCKS, BLOCK_SIZE, 4))
        cd.compile_engine(e, compiled=compiled, progress=False)
        alone.append(e.generate([r]).outputs[0])
    e = step05.LLMEngine(model, step05.EngineConfig(NUM_BLOCKS, BLOCK_SIZE, 4))
    cd.compile_engine(e, compiled=compiled, progress=False)
    calls = spy(compiled, monkeypatch)
    together = e.generate(reqs).outputs
    assert (3, 4) in calls and (4, 4) in calls
    arrivals = [Arrival(0, r) for r in reqs]
    check_equal(model, arrivals, alone, together)


def test_custom_ops_are_well_formed(compiled):
    """两个自定义算子：fake 实现与真实实现的形状、dtype、步长一致，mutates_args 声明的和实际改的一致
    （torch.library.opcheck；不编译，跑得快）。"""
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(2, 2, 5, 2, 4, 16, generator=g)                   # (layers, 2, num_blocks+1, H_kv, bs, D)
    k, v = torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    torch.library.opcheck(cd.write_kv_, (pool, 1, torch.tensor([0, 5, 13]), k, v))
    q = torch.randn(3, 4, 16, generator=g)
    tables = torch.tensor([[0, 1], [2, 4], [3, 4]], dtype=torch.int32)
    lens, qlens = torch.tensor([6, 3, 1], dtype=torch.int32), torch.ones(3, dtype=torch.int32)
    torch.library.opcheck(paged_attention_op, (q, pool[0, 0], pool[0, 1], tables, lens, qlens))


def test_engine_without_a_compiled_path_stays_eager_with_a_note(model):
    """gather 读法：一行说明，引擎保持 eager（decode 不经过编译的图）。"""
    notes = []
    e = step05.LLMEngine(model, step05.EngineConfig(NUM_BLOCKS, BLOCK_SIZE, 4, attention="gather"))
    assert not cd.compile_engine(e, log=notes.append)
    assert len(notes) == 1 and "decode stays eager" in notes[0] and not isinstance(e.model, cd.CompiledDecodeModel)


def test_run_py_compile_without_a_compiler_is_one_error_line(tiny_tok_dir, monkeypatch, capsys):
    """--compile 而 torch.compile 用不了（模拟：找不到 C++ 编译器）：一行 error:、退出码 2，不编译。"""
    from step05_paged import run as step05_run
    monkeypatch.setattr(cd, "compile_problem", lambda device: "no C++ compiler for torch.compile's CPU backend")
    line = cli_error(step05_run, ["--model", str(tiny_tok_dir), "--prompt", "hi", "--max-new-tokens", "2",
                                  "--compile"], capsys)
    assert "no C++ compiler" in line


def test_run_py_compile_with_a_quantized_pool_falls_back_to_eager(tiny_tok_dir, capsys):
    """step08 --kv-dtype int8 --compile：说一行"decode stays eager"，生成照常（与不加 --compile 相同）。"""
    import json

    from common import cli
    from step08_kv_quant import run as step08_run

    def run(*extra):
        with pytest.raises(SystemExit) as e:
            cli.run_main(step08_run.make_parser(), step08_run.main,
                         ["--model", str(tiny_tok_dir), "--prompt", "hello", "--max-new-tokens", "4", "--ignore-eos",
                          "--kv-dtype", "int8", "--json", *extra])
        out = capsys.readouterr().out
        assert e.value.code == 0, out[-2000:]
        return out
    plain, compiled = run(), run("--compile")
    assert "decode stays eager" in compiled and "decode stays eager" not in plain
    assert json.loads(compiled.splitlines()[-1])["results"] == json.loads(plain.splitlines()[-1])["results"]


def test_chapter_mode_rejects_compile(capsys):
    from step07_chunked_prefill import run as step07_run
    assert "generation mode" in cli_error(step07_run, ["--compile"], capsys)
