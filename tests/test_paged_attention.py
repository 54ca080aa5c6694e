"""PagedAttention 就地读池子（step05_paged/paged_attention.py）：C++ 内核、参考实现、gather 三种写法，
都与"按块表拼出连续 K/V 再调 F.scaled_dot_product_attention"相同；空块和不属于任何请求的槽里放 NaN，输出不变；
内核编不出来时给出有名字的后备（一行说明）或一行 `error:`。

随机池子：块在池子里随机打散、两个请求共用前缀块、最后一块不满、GQA 比 1 / 3 / 4（MQA：1 个 KV 头配 9 / 71 个 query 头）、head_dim 32 / 64 / 128、
decode（每个请求 1 个 query）与分块 prefill（query_len > 1，前面的 key 已在池子里）。
容差（float32）：|差| ≤ 1e-5 + 1e-5 · |期望|（实测最大差约 1e-6）。
"""
import math

import pytest
import torch
import torch.nn.functional as F

from common.cli import make_parser, run_main
from common.errors import UserError
from step05_paged import paged_attention as pa

TOL = dict(atol=1e-5, rtol=1e-5)
FAST_IMPLS = ("cpp", "reference", "gather")


def make_case(seed, seq_lens, query_lens, H_kv=3, G=3, D=64, bs=16, share_prefix=True, table_dtype=torch.int32):
    """一个随机池子和 B 个请求。每个请求的块从打乱的块号里取（不连续）；share_prefix 时请求 1 的前几块就是
    请求 0 的前几块（同一批物理块，像前缀缓存命中那样）。返回 (q, k_cache, v_cache, block_tables, seq_lens, query_lens)。"""
    g = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    need = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(need) + 5                                   # 多留几块不属于任何人的块
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for b, n in enumerate(need):
        if b == 1 and share_prefix and B > 1:
            shared = min(n, need[0]) - 1                         # 共用请求 0 的前 shared 块（都是满块）
            tables.append(tables[0][:max(shared, 0)] + [free.pop() for _ in range(n - max(shared, 0))])
        else:
            tables.append([free.pop() for _ in range(n)])
    max_blocks = max(need) + 1                                   # 每行至少补一个空块
    block_tables = torch.tensor([t + [num_blocks] * (max_blocks - len(t)) for t in tables], dtype=table_dtype)
    pool = torch.randn(2, num_blocks + 1, H_kv, bs, D, generator=g)
    q = torch.randn(sum(query_lens), H_kv * G, D, generator=g)
    return (q, pool[0], pool[1], block_tables, torch.tensor(seq_lens, dtype=torch.int32),
            torch.tensor(query_lens, dtype=torch.int32))


def sdpa_on_gathered(q, k_cache, v_cache, block_tables, seq_lens, query_lens):
    """期望值：逐个请求按块表把 K/V 拼成连续的 (H_kv, S, D)，GQA 用 repeat_interleave 显式复制到 H 个头
    （query 头 h 用 KV 头 h // G），因果掩码按绝对位置，交给 F.scaled_dot_product_attention。"""
    H, D = q.shape[1], q.shape[2]
    H_kv, bs = k_cache.shape[1], k_cache.shape[2]
    outs, row = [], 0
    for b in range(block_tables.shape[0]):
        S, L = int(seq_lens[b]), int(query_lens[b])
        blocks = block_tables[b, :-(-S // bs)].long()
        k = k_cache[blocks].transpose(0, 1).reshape(H_kv, -1, D)[:, :S]   # (n, H_kv, bs, D) -> (H_kv, S, D)
        v = v_cache[blocks].transpose(0, 1).reshape(H_kv, -1, D)[:, :S]
        k, v = k.repeat_interleave(H // H_kv, dim=0), v.repeat_interleave(H // H_kv, dim=0)   # (H, S, D)
        mask = torch.arange(S)[None, :] <= torch.arange(S - L, S)[:, None]                   # (L, S)
        qb = q[row:row + L].transpose(0, 1)                                                  # (H, L, D)
        outs.append(F.scaled_dot_product_attention(qb, k, v, attn_mask=mask).transpose(0, 1))  # (L, H, D)
        row += L
    return torch.cat(outs)


# decode：普通（请求 1 与请求 0 共用前两块）、正好满块、满块 + 1、长度 1；chunk：分块 prefill，前面已有若干 key（包括从 0 开始的整段 prefill）
SHAPES = {"decode": ([37, 45, 48, 49, 1], [1, 1, 1, 1, 1]),
          "chunk": ([37, 40, 16, 70, 9], [7, 40, 3, 1, 9])}


@pytest.mark.parametrize("mode", SHAPES)
@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("G", [1, 3, 4])
def test_impls_equal_sdpa_on_gathered_kv(G, D, mode):
    seq_lens, query_lens = SHAPES[mode]
    case = make_case(G * 1000 + D, seq_lens, query_lens, H_kv=2 if G == 4 else 3, G=G, D=D)
    expected = sdpa_on_gathered(*case)
    for impl in FAST_IMPLS:
        torch.testing.assert_close(pa.paged_attention(*case, impl=impl), expected, **TOL, msg=impl)


@pytest.mark.parametrize("mode", SHAPES)
@pytest.mark.parametrize("G", [9, 71])
def test_mqa_one_kv_head(G, mode):
    """MQA：全部 query 头共用 1 个 KV 头（H_kv = 1）。G = 9 是"SmolLM2 若训练成 MQA"，71 是 Falcon-7B 的头数。"""
    seq_lens, query_lens = SHAPES[mode]
    case = make_case(G, seq_lens, query_lens, H_kv=1, G=G, D=64)
    expected = sdpa_on_gathered(*case)
    for impl in FAST_IMPLS:
        torch.testing.assert_close(pa.paged_attention(*case, impl=impl), expected, **TOL, msg=impl)


@pytest.mark.parametrize("bs,D", [(1, 16), (8, 16), (32, 64), (16, 80)])
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_other_block_sizes_head_dims_and_table_dtypes(bs, D, table_dtype):
    case = make_case(bs + D, [33, 70, 2], [4, 1, 2], H_kv=2, G=2, D=D, bs=bs, table_dtype=table_dtype)
    expected = sdpa_on_gathered(*case)
    for impl in FAST_IMPLS:
        torch.testing.assert_close(pa.paged_attention(*case, impl=impl), expected, **TOL, msg=impl)


def test_split_over_two_threads_merges_like_one_pass():
    """两个线程、只有 1 个请求（3 个 KV 头 = 3 个任务）时内核把块表切成几段各算 (m, l, o) 再合并：
    结果与一个线程一遍算完的相同（到舍入），也与 SDPA 相同。块大小 4、长 200：50 块，切成 3 段。"""
    case = make_case(7, [200], [1], bs=4)
    one = pa.paged_attention_cpp(*case)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = pa.paged_attention_cpp(*case)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(two, one, **TOL)
    torch.testing.assert_close(two, sdpa_on_gathered(*case), **TOL)


def poison_unowned(case, value=float("nan")):
    """把空块和所有不属于任何请求（在它长度之内）的槽换成 value：没分出去的块、每个请求最后一块的尾巴。"""
    q, k_cache, v_cache, block_tables, seq_lens, query_lens = case
    bs = k_cache.shape[2]
    owned = torch.zeros(k_cache.shape[0], bs, dtype=torch.bool)                  # (num_blocks + 1, bs)
    for b in range(block_tables.shape[0]):
        for p in range(int(seq_lens[b])):
            owned[block_tables[b, p // bs], p % bs] = True
    assert not owned[-1].any()                                                   # 空块从不属于任何请求
    unowned = ~owned[:, None, :].expand(-1, k_cache.shape[1], -1)                # (num_blocks + 1, H_kv, bs)
    return q, k_cache.masked_fill(unowned[..., None], value), v_cache.masked_fill(unowned[..., None], value), \
        block_tables, seq_lens, query_lens


@pytest.mark.parametrize("impl", FAST_IMPLS)
@pytest.mark.parametrize("mode", SHAPES)
def test_null_block_and_unowned_slots_are_never_read(impl, mode):
    """池子里不属于任何请求的槽（包括补齐块表用的空块）全换成 NaN：输出仍然有限，且与干净的池子逐位相同。
    gather 读回了这些槽，靠掩码和清零 V 挡住；C++ 内核和参考实现根本不读它们（在 seq_lens 处停下）。"""
    case = make_case(3, *SHAPES[mode])
    clean = pa.paged_attention(*case, impl=impl)
    poisoned = pa.paged_attention(*poison_unowned(case), impl=impl)
    assert torch.isfinite(poisoned).all()
    assert torch.equal(poisoned, clean)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_block_mask_reads_the_right_blocks():
    """flex 写法的 BlockMask（块表 → 池子当成一条长序列里的段）算对了：不编译（eager 的 flex_attention 会把
    整张分数矩阵算出来，小例子里无妨），与 SDPA 相同。编译后的速度见 bench/paged_attention_bench.py。"""
    from torch.nn.attention.flex_attention import flex_attention
    case = make_case(5, [37, 40, 16], [7, 1, 3], H_kv=2, G=2, D=32)
    flex = pa._flex_compiled
    pa._flex_compiled = flex_attention
    try:
        out = pa.paged_attention(*case, impl="flex")
    finally:
        pa._flex_compiled = flex
    torch.testing.assert_close(out, sdpa_on_gathered(*case), **TOL)


def test_bad_tables_raise_instead_of_reading_outside_the_pool():
    q, k, v, bt, seq, ql = make_case(1, [20, 5], [1, 1])
    outside = bt.clone()
    outside[0, 0] = k.shape[0]                                   # 越界的块号
    with pytest.raises(ValueError, match="outside the pool"):
        pa.paged_attention_cpp(q, k, v, outside, seq, ql)
    with pytest.raises(ValueError, match="too short"):
        pa.paged_attention_cpp(q, k, v, bt[:, :1], seq, ql)      # 块表盖不住 seq_len
    with pytest.raises(ValueError, match="row count"):
        pa.paged_attention_cpp(q[:1], k, v, bt, seq, ql)


def test_auto_picks_the_kernel_on_cpu_float32():
    assert pa.kernel_available(), pa.kernel_build_error()
    assert pa.resolve_impl("auto", "cpu", torch.float32) == "cpp"
    assert pa.resolve_impl("auto", "cpu", torch.bfloat16) == "gather"
    assert pa.resolve_impl("auto", "cuda", torch.bfloat16) == "gather"
    with pytest.raises(UserError):
        pa.resolve_impl("fast", "cpu", torch.float32)


def test_build_is_cached(monkeypatch):
    """编过一次之后，build_kernel 只问一次编译器的版本（缓存文件名的一部分），不再编译，返回同一个文件。"""
    first = pa.build_kernel()                                    # 本次测试会话里第一次用到时才真的编译
    mtime = first.stat().st_mtime_ns
    calls = []
    real_run = pa.subprocess.run
    monkeypatch.setattr(pa.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or real_run(cmd, **kw))
    assert pa.build_kernel() == first and first.stat().st_mtime_ns == mtime
    assert [cmd[1:] for cmd in calls] == [["--version"]]
    assert first.parent == pa.kernel_dir() and not [p for p in first.parent.iterdir() if p.is_dir()]   # 临时目录已删


@pytest.fixture
def broken_compiler(monkeypatch, tmp_path, request):
    """换一个编不出东西的编译器（不存在的路径 / 总是失败的 `false`），并清掉进程里已加载的内核。"""
    monkeypatch.setenv("CXX", request.param)
    monkeypatch.setattr(pa, "kernel_dir", lambda: tmp_path)
    monkeypatch.setattr(pa, "_kernel", None)
    monkeypatch.setattr(pa, "_build_error", None)
    monkeypatch.setattr(pa, "_fallback_said", False)
    return request.param


@pytest.mark.parametrize("broken_compiler", ["/nonexistent/c++", "false"], indirect=True)
def test_build_failure_falls_back_to_gather_with_one_line(broken_compiler, capsys):
    case = make_case(2, [37, 5], [1, 1])
    out = pa.paged_attention(*case)                              # impl="auto"
    again = pa.paged_attention(*case)
    torch.testing.assert_close(out, pa.paged_attention_gather(*case), atol=0, rtol=0)
    torch.testing.assert_close(again, out, atol=0, rtol=0)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("paged attention: C++ kernel unavailable (") \
        and err[0].endswith("using the gather path (impl='gather')"), err
    assert not pa.kernel_available()


@pytest.mark.parametrize("broken_compiler", ["/nonexistent/c++", "false"], indirect=True)
def test_build_failure_with_impl_cpp_is_one_error_line(broken_compiler, capsys):
    """显式要 C++ 内核而编不出来：UserError，run.py 的 run_main 把它变成一行 `error: ...`、退出码 2。"""
    case = make_case(2, [37, 5], [1, 1])

    def main(args):
        pa.paged_attention(*case, impl="cpp")

    with pytest.raises(SystemExit) as exit_info:
        run_main(make_parser("test"), main, [])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: the C++ paged attention kernel could not be built: "), err
    assert "Traceback" not in err[0]


def test_online_softmax_over_blocks_worked_example():
    """第 05 章的手算例子：一个 query、一个头、D = 1，4 个 key 分两块（块大小 2）。
    q = 2（缩放 1/sqrt(1) = 1），k = [1, 0, 2, -1]：分数 s = [2, 0, 4, -2]；v = [1, 2, 3, 4]。
    第 0 块：m = 2，l = e^0 + e^-2，o = 1·e^0 + 2·e^-2；第 1 块：m_new = 4，alpha = e^-2，
    l = (1 + e^-2)·e^-2 + e^0 + e^-6，o = (1 + 2e^-2)·e^-2 + 3·e^0 + 4·e^-6；输出 o / l。"""
    k_cache = torch.tensor([1.0, 0.0, 2.0, -1.0]).view(2, 1, 2, 1)             # 2 块 × 1 头 × 2 槽 × D=1
    v_cache = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(2, 1, 2, 1)
    null = torch.zeros(1, 1, 2, 1)
    k_cache, v_cache = torch.cat([k_cache, null]), torch.cat([v_cache, null])   # 第 2 块是空块
    args = (torch.tensor([[[2.0]]]), k_cache, v_cache, torch.tensor([[0, 1]]), torch.tensor([4]), torch.tensor([1]))
    e = math.exp
    l = (1 + e(-2)) * e(-2) + 1 + e(-6)
    o = (1 + 2 * e(-2)) * e(-2) + 3 + 4 * e(-6)
    assert abs(o / l - 2.7522) < 1e-4                                           # 章里写的数
    for impl in FAST_IMPLS:
        assert abs(float(pa.paged_attention(*args, impl=impl)) - o / l) < 1e-6, impl
