"""step10：张量并行 / 流水线并行。

进程内（不起进程）：每个 rank 的切片拼回来就是完整的权重，每个 rank 的权重与 KV 池子是整体的 1/TP（TP > KV 头数
时 KV 头复制），切法不合法时一行 error。
多进程（gloo，每种切法起一组进程，跑完几种引擎配置）：TP = 2、PP = 2、TP × PP = 4 的引擎与一个进程的引擎在同一批
请求（贪心 + 带种子的采样、前缀命中、分块 prefill、重算抢占；换出抢占 + gather 读法）上按 run.py 的"相同"规则一致，
并报告最大的 logits 差；TP = 4（复制 KV 头）跑一个小一些的批。
出错与收尾、命令行与 torchrun 在 test_step10_processes.py。
"""
import datetime
import multiprocessing
import random
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from common.compare import MARGIN_TOL, compare
from common.config import ModelConfig
from common.errors import UserError
from common.harness import pool_is_free
from common.linear import dense_weight, linear_impl, linears
from common.weights import load_model
from conftest import cli_error, make_tiny_model_dir
from step02_sampling.sampler import SamplingParams, draw_margin
from step04_static_batching.request import Request
from step10_tensor_parallel import run as step10_run
from step10_tensor_parallel.distributed import Layout, WorkerFailed
from step10_tensor_parallel.launch import launch
from step10_tensor_parallel.model_runner import serve_worker
from step10_tensor_parallel.engine import EngineConfig, LLMEngine
from step10_tensor_parallel.kv_cache import PagedKVCache
from step10_tensor_parallel.parallel_layers import Shard, check_parallel, load_shard

TEST_TIMEOUT = datetime.timedelta(seconds=60)   # 挂住的通信最多等这么久就抛错，测试不会一直挂着
LAYOUTS = [(2, 1), (1, 2), (2, 2), (4, 1)]      # (tp, pp)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """4 个 query 头 / 2 个 KV 头、3 层（PP = 2 时分成 1 + 2 层）、词表 250（TP = 4 时最后一份补 2 行）、
    embedding 与 lm_head 共用权重。"""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tp"), "llama", num_hidden_layers=3, vocab_size=250,
                               tie_word_embeddings=True)


@pytest.fixture(scope="module")
def full(model_dir):
    return load_model(model_dir, "cpu", torch.float32)


# ---------- 进程内：切片与字节 ----------

@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_shards_reassemble_the_full_weights(tmp_path, arch):
    """TP = 2、PP = 2 的 4 个 rank：列切的层（q/k/v、gate/up、词表）按输出维、行切的层（o、down）按输入维拼回来
    就是完整模型的矩阵；bias（qwen2）、q/k norm（qwen3）、RMSNorm 跟着切或整份复制；每一层只在它的 stage 上。"""
    d = make_tiny_model_dir(tmp_path / arch, arch, num_hidden_layers=3)
    ref = dict(load_model(d, "cpu", torch.float32, "plain").named_parameters())        # 比的是切法：普通的 (in, out) 权重
    shards = [load_shard(d, Layout(r, 2, 2), "cpu", torch.float32, "plain") for r in range(4)]
    assert [list(m.shard.layers) for m in shards] == [[0], [0], [1, 2], [1, 2]]
    got = {}
    for m in shards:
        for name, p in m.named_parameters():
            layer, rest = name.split(".", 2)[1:] if name.startswith("layers.") else (None, name)
            full_name = f"layers.{m.shard.layers[int(layer)]}.{rest}" if layer is not None else name
            got.setdefault(full_name, {})[m.shard.tp_rank] = p.detach()
    assert set(got) == set(ref)
    for name, parts in got.items():
        a, b = parts[0], parts[1]
        if name.endswith(("o_proj.weight", "down_proj.weight")):           # 行切：(in, out) 的第 0 维
            whole = torch.cat([a, b], 0)
        elif name == "embed_tokens.weight":                                # (V, E) 按行
            whole = torch.cat([a, b], 0)
        elif a.shape == ref[name].shape:                                   # 复制的：两份相同
            assert torch.equal(a, b), name
            whole = a
        else:                                                              # 列切：输出维（最后一维）
            whole = torch.cat([a, b], -1)
        assert torch.equal(whole, ref[name]), name


def test_packed_shards_hold_the_same_slices_and_compute_the_same(model_dir):
    """切片层（列切、行切、词表切的 lm_head）用的是 common/linear.py 的同一个实现：默认（CPU float32）打包，
    打包的切片还原回来与 plain 的切片逐位相同，前向（单 rank：TP = PP = 1）与 plain 的 logits 只差舍入。"""
    ids, pos = torch.tensor([[3, 17, 42, 9, 77]]), torch.arange(5)[None]
    group = SimpleNamespace(size=1, gather=lambda y: y, all_reduce=lambda y: None)         # 一个 rank：通信什么也不做
    one = Layout(0, 1, 1)                                                               # 一个 rank 的位置
    one.tp_group, one.stats = group, SimpleNamespace(add=lambda *a: None)
    for r in range(2):
        packed, plain = (load_shard(model_dir, Layout(r, 2, 2), "cpu", torch.float32, impl) for impl in ("auto", "plain"))
        assert linear_impl(packed) == "packed" and linear_impl(plain) == "plain"
        assert all(m.weight is None for m in linears(packed))                       # 只留打包的那一份
        for a, b in zip(linears(packed), linears(plain)):
            assert type(a) is type(b) and torch.equal(dense_weight(a), b.weight)
    packed, plain = (load_shard(model_dir, one, "cpu", torch.float32, impl) for impl in ("packed", "plain"))
    with torch.inference_mode():
        diff = (packed(ids, pos) - plain(ids, pos)).abs().max().item()
    assert diff < 1e-4                # 另一个内核，求和顺序可以不同：差别只在末位（这么小的矩阵上常常逐位相同）


def param_bytes(model) -> int:
    return sum(p.nbytes for p in model.parameters())


def test_each_rank_holds_1_over_tp_of_the_weights_and_of_the_kv_pool(model_dir, full):
    """TP = 2：每个 rank 的权重字节 = (整体 − 复制的 RMSNorm) / 2 + RMSNorm；KV 池子（同样的块数）正好一半。
    TP = 4 > 2 个 KV 头：KV 头复制，rank r 存第 r // 2 个 KV 头（与 vLLM 相同），池子是整体的 1/2 而不是 1/4。"""
    cfg = full.cfg
    norms = sum(p.nbytes for n, p in full.named_parameters() if "norm" in n)
    pool = PagedKVCache(cfg, 8, 4, "cpu", torch.float32).nbytes
    for r in range(2):
        m = load_shard(model_dir, Layout(r, 2, 1), "cpu", torch.float32)
        assert param_bytes(m) - norms == (param_bytes(full) - norms) / 2
        assert PagedKVCache(m.cfg, 8, 4, "cpu", torch.float32).nbytes * 2 == pool
    D = cfg.head_dim
    for r in range(4):
        m = load_shard(model_dir, Layout(r, 4, 1), "cpu", torch.float32)
        assert m.shard.kv_heads == range(r // 2, r // 2 + 1) and m.cfg.num_kv_heads == 1 and m.cfg.num_heads == 1
        k = dense_weight(m.layers[0].self_attn.k_proj)                                  # (E, D)
        assert torch.equal(k, dense_weight(full.layers[0].self_attn.k_proj)[:, r // 2 * D:(r // 2 + 1) * D])
        assert PagedKVCache(m.cfg, 8, 4, "cpu", torch.float32).nbytes * 2 == pool
    last = load_shard(model_dir, Layout(3, 4, 1), "cpu", torch.float32)                    # 词表 250 = 63 × 4 − 2
    assert last.embed_tokens.weight.shape[0] == 63 and not last.embed_tokens.weight[-2:].any()


def test_layouts_that_do_not_fit_the_model_are_errors(full, model_dir, capsys):
    cfg = full.cfg                                                   # 4 个 query 头、2 个 KV 头、F = 128、3 层
    for tp, pp, words in ((3, 1, "query heads"), (8, 1, "query heads"), (1, 4, "layers")):
        with pytest.raises(UserError, match=words):
            check_parallel(cfg, tp, pp)
    from dataclasses import replace
    with pytest.raises(UserError, match="KV heads"):                # tp = 6 整除 12 个头，却既不整除 4 个 KV 头，也不是它的倍数
        check_parallel(replace(cfg, num_heads=12, num_kv_heads=4, intermediate_size=96), 6, 1)
    with pytest.raises(UserError, match="MLP width"):
        check_parallel(replace(cfg, intermediate_size=126), 4, 1)
    check_parallel(cfg, 4, 1)                                        # 4 > 2 个 KV 头：复制，合法
    # 命令行：在起任何进程之前就是一行 error、退出码 2
    assert "query heads" in cli_error(step10_run, ["--model", str(model_dir), "--prompt", "hi", "--tp", "3"], capsys)


def test_torchrun_world_size_must_match_tp_times_pp(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(UserError, match="torchrun started 3 processes"):
        with launch(2, 1):
            pass


# ---------- 多进程：与一个进程的引擎相同 ----------

class Recorder:
    """包住模型：记下 rank 0 每次前向的 logits（比较 TP 与一个进程时的最大差）。"""

    def __init__(self, model):
        self.model, self.logits = model, []

    def __getattr__(self, name):
        return getattr(self.__dict__["model"], name)

    def __call__(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        self.logits.append(out)
        return out


def workload(n: int = 6) -> list[Request]:
    """n 个请求：奇数号带种子采样，其余贪心；第 4 个与第 1 个提示词相同（前缀命中）。"""
    rng = random.Random(10)
    prompts = [[rng.randrange(2, 250) for _ in range(rng.randint(3, 30))] for _ in range(6)]
    prompts[4] = list(prompts[1])
    return [Request(p, rng.randint(8, 16), SamplingParams(temperature=0.9, top_p=0.95, seed=7 + i) if i % 2
                    else SamplingParams(), ignore_eos=True) for i, p in enumerate(prompts)][:n]


# 名字 → (引擎配置, 请求数)：池子小到一定抢占，预算 16 让长提示词分块 prefill；"draft"：投机解码，完整模型自己当
# 草稿（只在 rank 0 上），贪心的请求每步都有 k 个猜测要验证——计划里带着猜测的行
CASES = {"recompute": (EngineConfig(20, 4, 4, 16), 6),
         "swap-gather": (EngineConfig(20, 4, 4, 16, preempt="swap", attention="gather"), 6),
         "draft": (EngineConfig(40, 4, 4, 32, spec_method="draft", num_spec_tokens=3), 6)}
# TP = 4：4 个进程在 2 核上每次 all-reduce 都要轮流调度 4 次，慢得多；它要证明的是复制的 KV 头，小批就够了
SMALL = {"replicated-kv": (EngineConfig(20, 4, 4, 16), 3)}


def run_engine(model, config, requests, draft, parallel=None):
    engine = LLMEngine(model, config, draft_model=draft if config.spec_method == "draft" else None, parallel=parallel)
    engine.model = rec = Recorder(engine.model)
    out, st = engine.generate(requests)
    comm = engine.close()
    assert pool_is_free(engine)
    return out, st, rec.logits, comm, engine.spec_stats


@pytest.fixture(params=LAYOUTS, ids=[f"tp{t}-pp{p}" for t, p in LAYOUTS])
def group(request, model_dir):
    """一种切法起一组进程（rank 0 是测试进程自己）；同一组进程跑完 CASES 里的每个引擎配置。"""
    tp, pp = request.param
    with launch(tp, pp, serve_worker, (model_dir, "cpu", torch.float32), threads=1, timeout=TEST_TIMEOUT) as par:
        yield par, load_shard(model_dir, par, "cpu", torch.float32)
    assert not dist.is_initialized() and not multiprocessing.active_children()


def test_parallel_engine_equals_one_process(group, full):
    """每种配置：输出按"相同"规则与一个进程的引擎一致（贪心看 top-2 差，采样看抽样点到区间边界的距离，容差 1e-3，
    分歧按名字报告），抢占也一样发生；在两边的调度还相同的那些步里，rank 0 的 logits 与一个进程的最大差很小
    （all-reduce 改变了 float32 的求和顺序：不要求逐位相同）。"""
    par, model = group
    logits_fn = lambda ids: full(torch.tensor([ids]), torch.arange(len(ids))[None])[0]   # noqa: E731
    for name, (config, n) in (SMALL if par.tp_size == 4 else CASES).items():
        requests = workload(n)
        if name == "draft":
            requests = [Request(r.prompt_ids, r.max_new_tokens, ignore_eos=True) for r in requests]   # 贪心
        ref, st_ref, ref_logits, _, spec_ref = run_engine(full, config, requests, full)
        out, st, got_logits, comm, spec = run_engine(model, config, requests, full, par)
        assert st.preemptions == st_ref.preemptions and (st.preemptions > 0 or n < 6 or name == "draft"), name
        assert spec == spec_ref and (spec.accepted > 0) == (name == "draft"), name
        results = [compare(f"{name}/request {i}", r.prompt_ids, a, b, logits_fn, MARGIN_TOL[torch.float32],
                           draw_margin(r.params)) for i, (r, a, b) in enumerate(zip(requests, ref, out))]
        assert all(c.ok for c in results), [c.describe() for c in results if not c.ok]
        diffs = [float((a - b).abs().max()) for a, b in zip(ref_logits, got_logits)
                 if a.shape == b.shape and a.numel()]
        print(f"tp{par.tp_size} pp{par.pp_size} {name}: max |Δlogit| {max(diffs):.2e} over {len(diffs)} steps; "
              + "; ".join(c.describe() for c in results if not c.equal))
        assert max(diffs) < 1e-3
        assert len(comm) == par.world_size
        if par.tp_size > 1:   # rank 0 在第一个 stage：它的每一层两次 all-reduce，外加 embedding 一次
            assert comm[0]["all_reduce"][0] == st.num_forwards * (2 * len(model.layers) + 1)
